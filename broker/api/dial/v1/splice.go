package dial

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/utils/clock"

	"github.com/kcp-dev/tunnel-broker/broker/internal/abortable"
	"github.com/kcp-dev/tunnel-broker/broker/metrics"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// failure is the end of a splice that was not clean, with the side at fault.
// A failure by neither side (the broker's own: shutdown, idle) carries the
// statuses for both.
type failure struct {
	byCaller bool
	err      error
	// Set for the broker's own reasons.
	callerStatus, agentStatus error
}

// splice carries bytes both ways between the caller's Dial stream and the
// agent's Tunnel stream until both directions are half-closed, or either side
// fails.
//
// Each RPC's handler copies one direction: the Dial handler the caller's
// bytes up to the agent, the agent's Tunnel handler the agent's bytes down to
// the caller. That is two goroutines a tunnel, the least two gRPC streams
// allow. A copy blocked on one stream does not see the other end, so the
// first failure ends both RPCs with their statuses (package abortable),
// which frees both copies whatever the peers do. What can end a tunnel from
// outside (either stream's end, the broker's stop, the idle timer) is
// watched by callbacks, not goroutines.
//
// Ending an RPC ends its stream, and the other direction's copy writes to
// it: the Dial handler returns only once the down copy is done, and the
// Tunnel handler only once the splice has finished its tunnel.
type splice struct {
	caller   tunnelv1.DialService_DialServer
	agent    tunnelv1.AgentService_TunnelServer
	idle     time.Duration // 0: never
	clock    clock.WithDelayedExecution
	ended    func() // if set, called once the end is known, before either peer hears it
	active   activity
	downDone chan struct{}

	mu        sync.Mutex
	settled   bool     // the end is known; later failures change nothing
	end       *failure // the first failure; nil for a clean end
	idleTimer clock.Timer
}

// run splices from the Dial handler until both copies are done; start hands
// the down copy to the agent's Tunnel handler (registry.Tunnel.Start). It
// returns the status that ends each RPC (nil for OK).
func (sp *splice) run(start func(down func()) bool, stopping context.Context) (callerStatus, agentStatus error) {
	if !abortable.Supported(sp.caller.Context()) || !abortable.Supported(sp.agent.Context()) {
		err := status.Error(codes.Internal, "this build of the broker cannot end a gRPC stream from outside its handler (package abortable)")
		return err, err
	}
	sp.downDone = make(chan struct{})
	sp.active.clock = sp.clock
	sp.active.touch()
	unwatch := sp.watch(stopping)
	if !start(sp.down) {
		// The agent's Tunnel RPC ended before it could take its half.
		sp.fail(&failure{err: context.Cause(sp.agent.Context())})
		close(sp.downDone)
	}
	if f := copyUp(sp.caller, sp.agent, &sp.active); f != nil {
		sp.fail(f)
	}
	<-sp.downDone
	unwatch()
	sp.mu.Lock()
	sp.settled = true
	end := sp.end
	sp.mu.Unlock()
	return end.statuses()
}

// down is the agent's half, run by its Tunnel handler.
func (sp *splice) down() {
	if f := copyDown(sp.agent, sp.caller, &sp.active); f != nil {
		sp.fail(f)
	}
	close(sp.downDone)
}

// fail ends the splice with f, unless it has ended already: it ends both
// RPCs with their statuses, which frees both copies.
func (sp *splice) fail(f *failure) {
	sp.mu.Lock()
	first := !sp.settled
	if first {
		sp.settled, sp.end = true, f
	}
	sp.mu.Unlock()
	if first {
		if sp.ended != nil {
			sp.ended()
		}
		callerStatus, agentStatus := f.statuses()
		abortable.End(sp.caller.Context(), callerStatus)
		abortable.End(sp.agent.Context(), agentStatus)
	}
}

// watch fails the splice when either stream ends, when stopping ends, or
// when the tunnel has been idle too long. unwatch undoes it.
func (sp *splice) watch(stopping context.Context) (unwatch func()) {
	callerCtx, agentCtx := sp.caller.Context(), sp.agent.Context()
	// On contexts of the standard library, AfterFunc starts no goroutine
	// until its context ends.
	stopCaller := context.AfterFunc(callerCtx, func() {
		sp.fail(&failure{byCaller: true, err: context.Cause(callerCtx)})
	})
	stopAgent := context.AfterFunc(agentCtx, func() {
		sp.fail(&failure{err: context.Cause(agentCtx)})
	})
	stopStopping := context.AfterFunc(stopping, func() {
		sp.fail(&failure{
			callerStatus: status.Error(codes.Unavailable, "the broker is shutting down and its grace period is over"),
			agentStatus:  status.Error(codes.Unavailable, "the broker is shutting down"),
		})
	})
	if sp.idle > 0 {
		sp.mu.Lock()
		sp.idleTimer = sp.clock.AfterFunc(sp.idle, sp.checkIdle)
		sp.mu.Unlock()
	}
	return func() {
		stopCaller()
		stopAgent()
		stopStopping()
		sp.mu.Lock()
		if sp.idleTimer != nil {
			sp.idleTimer.Stop()
		}
		sp.mu.Unlock()
	}
}

// checkIdle ends a tunnel that carried nothing for sp.idle, or looks again
// when it could have.
func (sp *splice) checkIdle() {
	quiet := sp.active.since()
	if quiet < sp.idle {
		sp.mu.Lock()
		if !sp.settled {
			sp.idleTimer.Reset(sp.idle - quiet)
		}
		sp.mu.Unlock()
		return
	}
	metrics.LimitsHit.WithLabelValues("idle_timeout").Inc()
	msg := fmt.Sprintf("tunnel carried nothing for %v", sp.idle)
	sp.fail(&failure{callerStatus: status.Error(codes.DeadlineExceeded, msg), agentStatus: status.Error(codes.DeadlineExceeded, msg)})
}

// statuses are the statuses that end the caller's and the agent's RPC.
func (f *failure) statuses() (callerStatus, agentStatus error) {
	switch {
	case f == nil:
		return nil, nil
	case f.callerStatus != nil:
		return f.callerStatus, f.agentStatus
	case f.byCaller:
		if status.Code(f.err) == codes.InvalidArgument {
			return f.err, status.Errorf(codes.Canceled, "caller broke the protocol: %v", f.err)
		}
		return status.Error(codes.Canceled, "caller went away"),
			status.Errorf(codes.Canceled, "caller went away: %v", f.err)
	default:
		return status.Errorf(codes.Unavailable, "tunnel lost on the agent's side: %v", f.err),
			status.Errorf(codes.Aborted, "tunnel aborted: %v", f.err)
	}
}

// activity is when a tunnel last carried a frame.
type activity struct {
	clock clock.PassiveClock
	last  atomic.Int64
}

func (a *activity) touch() { a.last.Store(a.clock.Now().UnixNano()) }
func (a *activity) since() time.Duration {
	return time.Duration(a.clock.Now().UnixNano() - a.last.Load())
}

// copyUp forwards the caller's bytes to the agent, then its half-close. Data
// frames pass through in their wire encoding (tunnelv1.Frame).
func copyUp(caller tunnelv1.DialService_DialServer, agent tunnelv1.AgentService_TunnelServer, active *activity) *failure {
	for {
		var f tunnelv1.Frame
		err := caller.RecvMsg(&f)
		if errors.Is(err, io.EOF) {
			if err := agent.Send(&tunnelv1.TunnelResponse{Frame: &tunnelv1.TunnelResponse_CloseWrite{CloseWrite: &tunnelv1.CloseWrite{}}}); err != nil {
				return &failure{err: err}
			}
			return nil
		}
		if err != nil {
			return &failure{byCaller: true, err: err}
		}
		active.touch()
		n, err := f.DataLen()
		if err != nil {
			f.Free()
			return &failure{byCaller: true, err: status.Error(codes.InvalidArgument, "protocol error: after the target, a caller may only send non-empty data")}
		}
		if err := agent.SendMsg(&f); err != nil {
			return &failure{err: err}
		}
		metrics.BytesUp.Add(float64(n))
	}
}

// copyDown forwards the agent's bytes to the caller, then its half-close.
func copyDown(agent tunnelv1.AgentService_TunnelServer, caller tunnelv1.DialService_DialServer, active *activity) *failure {
	for {
		var f tunnelv1.Frame
		err := agent.RecvMsg(&f)
		if errors.Is(err, io.EOF) {
			if err := caller.Send(&tunnelv1.DialResponse{Frame: &tunnelv1.DialResponse_CloseWrite{CloseWrite: &tunnelv1.CloseWrite{}}}); err != nil {
				return &failure{byCaller: true, err: err}
			}
			return nil
		}
		if err != nil {
			return &failure{err: err}
		}
		active.touch()
		n, err := f.DataLen()
		if err != nil {
			f.Free()
			return &failure{err: errors.New("protocol error: after opening, an agent may only send non-empty data")}
		}
		if err := caller.SendMsg(&f); err != nil {
			return &failure{byCaller: true, err: err}
		}
		metrics.BytesDown.Add(float64(n))
	}
}
