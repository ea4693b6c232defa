package tunnel

import (
	"cmp"
	"context"
	"errors"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/utils/clock"

	"github.com/kcp-dev/tunnel-broker/broker/internal/abortable"
	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
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

// Splice splices the tunnel with the caller's Dial stream until the tunnel
// ends, from the caller's Dial RPC, and returns the statuses of the caller's
// and the agent's RPC (nil: OK); the agent's RPC has ended by then. ended, if
// set, runs once as soon as the end is known, before either peer can hear
// of it: a caller told that its tunnel ended may dial again at once.
func (t *Tunnel) Splice(caller grpc.ServerStream, cfg Config, ended func()) (callerStatus, agentStatus error) {
	t.caller = caller
	t.clock = cfg.Clock
	if t.clock == nil {
		t.clock = clock.RealClock{}
	}
	t.idleLimit = cmp.Or(cfg.IdleTimeout, DefaultIdleTimeout)
	t.onEnd = sync.OnceFunc(func() {
		t.claim.Release()
		if cfg.Table != nil {
			cfg.Table.Remove(t)
		}
		if ended != nil {
			ended()
		}
	})
	if !abortable.Supported(caller.Context()) || !abortable.Supported(t.agent.Context()) {
		err := status.Error(codes.Internal, "this build of the broker cannot end a gRPC stream from outside its handler (package abortable)")
		t.onEnd()
		t.End(err)
		return err, err
	}
	t.downDone = make(chan struct{})
	t.touch()
	if cfg.Table != nil {
		cfg.Table.Add(t)
	}
	unwatch := t.watch(cfg.Stopping)
	if !t.beginSplice() {
		// The agent's Tunnel RPC returned before it could copy down.
		t.fail(&failure{by: agentSide, err: context.Cause(t.agent.Context())})
		close(t.downDone)
	}
	t.copyUp()
	<-t.downDone
	unwatch()
	callerStatus, agentStatus = t.decideEnd().statuses()
	t.onEnd()
	t.End(agentStatus)
	return callerStatus, agentStatus
}

// A direction is one way through the tunnel: up, from the caller to the
// agent, or down, from the agent to the caller. Its messages are made only
// when needed: an idle tunnel holds none.
type direction struct {
	from, to         grpc.ServerStream
	fromSide, toSide side
	// closeWrite is the message that tells to that from half-closed.
	closeWrite func() any
	// notData is the failure of a from that sends anything but data.
	notData func() error
	bytes   prometheus.Counter
	carried *atomic.Int64 // this tunnel's bytes this way
}

// copyUp forwards the caller's bytes to the agent, in the Dial RPC: first
// the early data its order did not carry, then the caller's frames.
func (t *Tunnel) copyUp() {
	d := direction{
		from: t.caller, to: t.agent, fromSide: callerSide, toSide: agentSide,
		closeWrite: closeWriteToAgent, notData: callerSentNotData, bytes: metrics.BytesUp, carried: &t.bytesUp,
	}
	if early := t.earlyData; len(early) > 0 {
		t.earlyData = nil
		if !t.send(d, &tunnelv1.TunnelResponse{Frame: &tunnelv1.TunnelResponse_Data{Data: early}}, len(early)) {
			return
		}
	}
	t.forward(d)
}

// copyDown forwards the agent's bytes to the caller, in the agent's Tunnel
// RPC.
func (t *Tunnel) copyDown() {
	defer close(t.downDone)
	t.forward(direction{
		from: t.agent, to: t.caller, fromSide: agentSide, toSide: callerSide,
		closeWrite: closeWriteToCaller, notData: agentSentNotData, bytes: metrics.BytesDown, carried: &t.bytesDown,
	})
}

func closeWriteToAgent() any {
	return &tunnelv1.TunnelResponse{Frame: &tunnelv1.TunnelResponse_CloseWrite{CloseWrite: &tunnelv1.CloseWrite{}}}
}

func closeWriteToCaller() any {
	return &tunnelv1.DialResponse{Frame: &tunnelv1.DialResponse_CloseWrite{CloseWrite: &tunnelv1.CloseWrite{}}}
}

func callerSentNotData() error {
	return status.Error(codes.InvalidArgument, "protocol error: after the target, a caller may only send non-empty data")
}

func agentSentNotData() error {
	return errors.New("protocol error: after opening, an agent may only send non-empty data")
}

// forward copies d's data frames as they were received, without decoding
// them (wire.Frame), until its sender half-closes, and then tells the
// receiver so. The first failure on either leg ends the tunnel.
func (t *Tunnel) forward(d direction) {
	for {
		var f wire.Frame
		err := d.from.RecvMsg(&f)
		if errors.Is(err, io.EOF) {
			if err := d.to.SendMsg(d.closeWrite()); err != nil {
				t.fail(&failure{by: d.toSide, err: err})
			}
			return
		}
		if err != nil {
			t.fail(&failure{by: d.fromSide, err: err})
			return
		}
		t.touch()
		n, err := f.DataLen()
		if err != nil {
			f.Free()
			t.fail(&failure{by: d.fromSide, err: d.notData()})
			return
		}
		if !t.send(d, &f, n) {
			return
		}
	}
}

// send sends msg, n bytes of data, d's way and counts them; false if that
// failed the tunnel.
func (t *Tunnel) send(d direction, msg any, n int) bool {
	if err := d.to.SendMsg(msg); err != nil {
		t.fail(&failure{by: d.toSide, err: err})
		return false
	}
	d.bytes.Add(float64(n))
	d.carried.Add(int64(n))
	return true
}
