package tunnel

import (
	"cmp"
	"context"
	"errors"
	"io"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/utils/clock"

	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// Config is what ends a broker's tunnels besides their peers.
type Config struct {
	// IdleTimeout ends a tunnel that carries nothing for so long; zero:
	// DefaultIdleTimeout, negative: never.
	IdleTimeout time.Duration
	// Stopping ends every tunnel with Unavailable when it ends: the
	// broker's grace period for tunnels in flight is over. Nil: never.
	Stopping context.Context
	// Clock times the idle limit; nil: the real clock.
	Clock clock.WithDelayedExecution
	// Table lists the tunnel while it is spliced; nil: none.
	Table *Table
}

// Splice splices the tunnel with the caller's leg until the tunnel ends,
// and returns the statuses it ended the caller's and the agent's legs with
// (nil: OK). Each direction is copied by a goroutine of its own; Splice
// waits for the end, ends both legs, and returns, so that a front end's
// RPC handler returns its leg's status itself. released, if set, runs once
// the copiers are gone, which on a clean end is before either peer can hear
// of it: a caller told that its tunnel ended may dial again at once. After
// a failure the copiers return as soon as both legs have ended.
func (t *Tunnel) Splice(caller Leg, cfg Config, released func()) (callerStatus, agentStatus error) {
	t.endOnce.Do(func() {}) // End no longer ends it: the splice does.
	t.caller = caller
	t.clock = cfg.Clock
	if t.clock == nil {
		t.clock = clock.RealClock{}
	}
	t.idleLimit = cmp.Or(cfg.IdleTimeout, DefaultIdleTimeout)
	// The last copier to return runs it, once.
	t.onEnd = func() {
		t.claim.Release()
		if cfg.Table != nil {
			cfg.Table.Remove(t)
		}
		if released != nil {
			released()
		}
	}
	t.touch()
	if cfg.Table != nil {
		cfg.Table.Add(t)
	}
	unwatch := t.watch(cfg.Stopping)
	t.copiers.Store(2)
	go t.copy(t.up())
	go t.copy(t.down())
	<-t.decided
	unwatch()
	callerStatus, agentStatus = t.failure.statuses(t.ID)
	caller.End(callerStatus)
	t.agent.End(agentStatus)
	return callerStatus, agentStatus
}

// A direction is one way through the tunnel: up, from the caller to the
// agent, or down, from the agent to the caller.
type direction struct {
	from, to         Leg
	fromSide, toSide side
	// notData is the failure of a from that sends anything but data.
	notData func() error
	bytes   prometheus.Counter
	carried *atomic.Int64 // this tunnel's bytes this way
}

func (t *Tunnel) up() direction {
	return direction{from: t.caller, to: t.agent, fromSide: callerSide, toSide: agentSide,
		notData: CallerSentNotData, bytes: metrics.BytesUp, carried: &t.bytesUp}
}

func (t *Tunnel) down() direction {
	return direction{from: t.agent, to: t.caller, fromSide: agentSide, toSide: callerSide,
		notData: agentSentNotData, bytes: metrics.BytesDown, carried: &t.bytesDown}
}

// CallerSentNotData is the failure of a caller that sends anything but data
// after its target.
func CallerSentNotData() error {
	return status.Error(codes.InvalidArgument, "protocol error: after the target, a caller may only send non-empty data")
}

func agentSentNotData() error {
	return errors.New("protocol error: after opening, an agent may only send non-empty data")
}

// copy runs one direction in its own goroutine. The last copier to return
// decides a clean end, unless a failure came first, and then stops the
// tunnel's counting: nothing of the tunnel runs any more.
func (t *Tunnel) copy(d direction) {
	t.forward(d)
	if t.copiers.Add(-1) == 0 {
		t.onEnd()
		t.decide(nil)
	}
}

// forward copies d's data frames as they were received, without decoding
// them (wire.Frame), until its sender half-closes, and then tells the
// receiver so. The first failure on either leg ends the tunnel.
func (t *Tunnel) forward(d direction) {
	for {
		var f wire.Frame
		err := d.from.Recv(&f)
		if errors.Is(err, io.EOF) {
			if err := d.to.CloseWrite(); err != nil {
				t.decide(&failure{by: d.toSide, err: err})
			}
			return
		}
		if err != nil {
			t.decide(&failure{by: d.fromSide, err: err})
			return
		}
		t.touch()
		n, err := f.DataLen()
		if err != nil {
			f.Free()
			t.decide(&failure{by: d.fromSide, err: d.notData()})
			return
		}
		if err := d.to.Send(&f); err != nil {
			t.decide(&failure{by: d.toSide, err: err})
			return
		}
		d.bytes.Add(float64(n))
		d.carried.Add(int64(n))
	}
}
