package tunnel

import (
	"cmp"
	"context"
	"time"

	"k8s.io/utils/clock"

	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/internal/splice"
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

// Splice splices the tunnel with the caller's leg until the tunnel ends
// (splice.Splice, the caller's leg as A and the agent's as B), and returns
// the statuses it ended the caller's and the agent's legs with (nil: OK),
// so that a front end's RPC handler returns its leg's status itself.
// released, if set, runs once the copiers are gone, which on a clean end is
// before either peer can hear of it: a caller told that its tunnel ended
// may dial again at once. After a failure the copiers return as soon as
// both legs have ended.
func (t *Tunnel) Splice(caller Leg, cfg Config, released func()) (callerStatus, agentStatus error) {
	t.endOnce.Do(func() {}) // End no longer ends it: the splice does.
	t.clock = cmp.Or[clock.WithDelayedExecution](cfg.Clock, clock.RealClock{})
	t.idleLimit = cmp.Or(cfg.IdleTimeout, DefaultIdleTimeout)
	stop, stopNow := context.WithCancelCause(context.Background())
	defer stopNow(nil)
	if cfg.Stopping != nil {
		defer context.AfterFunc(cfg.Stopping, func() { stopNow(errStopping) })()
	}
	t.touch()
	if cfg.Table != nil {
		cfg.Table.Add(t)
	}
	t.startIdleTimer(stopNow)
	defer t.stopIdleTimer()
	_, callerStatus, agentStatus = splice.Splice(caller, t.agent, splice.Config{
		Stop:     stop,
		Carried:  t.carried,
		Statuses: t.statuses,
		Released: func() {
			t.claim.Release()
			if cfg.Table != nil {
				cfg.Table.Remove(t)
			}
			if released != nil {
				released()
			}
		},
	})
	return callerStatus, agentStatus
}

// carried counts a data frame of n bytes from the leg from, and notes that
// the tunnel is not idle.
func (t *Tunnel) carried(from splice.Side, n int) {
	t.touch()
	if from == splice.A {
		metrics.BytesUp.Add(float64(n))
		t.bytesUp.Add(int64(n))
	} else {
		metrics.BytesDown.Add(float64(n))
		t.bytesDown.Add(int64(n))
	}
}
