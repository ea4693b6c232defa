package dial

import (
	"errors"
	"fmt"
	"io"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

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

// splicer holds what a splice watches besides its two streams.
type splicer struct {
	// stopping closes when the broker's grace period is over.
	stopping <-chan struct{}
	// idle ends a tunnel that carried nothing for this long; 0 for never.
	idle time.Duration
}

// splice carries bytes both ways between the caller's Dial stream and the
// agent's Tunnel stream until both directions are half-closed, or either side
// fails. It returns the status that ends each RPC (nil for OK).
//
// Each direction runs in its own goroutine because a gRPC Recv or Send
// cannot be interrupted: only the end of its RPC frees it. Each copy uses
// both streams, so neither RPC's own handler may run one (it could block on
// its own stream forever); the handlers only wait, and when one side fails
// both return, which frees whatever the copies are blocked in. That makes
// four goroutines a tunnel, the least this robustness allows with gRPC's
// blocking streams.
func (sp splicer) splice(caller tunnelv1.DialService_DialServer, agent tunnelv1.AgentService_TunnelServer) (callerStatus, agentStatus error) {
	var active activity
	active.touch()
	results := make(chan *failure, 2)
	go func() { results <- copyUp(caller, agent, &active) }()
	go func() { results <- copyDown(agent, caller, &active) }()
	var idle <-chan time.Time
	if sp.idle > 0 {
		t := time.NewTicker(sp.idle / 4)
		defer t.Stop()
		idle = t.C
	}
	for pending := 2; pending > 0; {
		var f *failure
		// A copy blocked in Send on one stream does not see the other
		// stream end, so watch both ends here as well.
		select {
		case f = <-results:
			pending--
		case <-caller.Context().Done():
			f = &failure{byCaller: true, err: caller.Context().Err()}
		case <-agent.Context().Done():
			f = &failure{err: agent.Context().Err()}
		case <-sp.stopping:
			f = &failure{
				callerStatus: status.Error(codes.Unavailable, "the broker is shutting down and its grace period is over"),
				agentStatus:  status.Error(codes.Unavailable, "the broker is shutting down"),
			}
		case <-idle:
			if active.since() < sp.idle {
				continue
			}
			metrics.LimitsHit.WithLabelValues("idle_timeout").Inc()
			msg := fmt.Sprintf("tunnel carried nothing for %v", sp.idle)
			f = &failure{callerStatus: status.Error(codes.DeadlineExceeded, msg), agentStatus: status.Error(codes.DeadlineExceeded, msg)}
		}
		switch {
		case f == nil:
			continue
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
	return nil, nil
}

// activity is when a tunnel last carried a frame.
type activity struct{ last atomic.Int64 }

func (a *activity) touch()               { a.last.Store(time.Now().UnixNano()) }
func (a *activity) since() time.Duration { return time.Duration(time.Now().UnixNano() - a.last.Load()) }

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
