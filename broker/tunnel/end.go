package tunnel

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"syscall"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/internal/redact"
)

// side is whom a failure is laid to.
type side int

const (
	callerSide side = iota
	agentSide
	// brokerSide: the broker's own reasons, its stop or the idle limit.
	brokerSide
)

// failure is the end of a tunnel that did not end cleanly.
type failure struct {
	by  side
	err error
	// For the broker's own reasons, the statuses of both legs.
	callerStatus, agentStatus error
}

// byBroker is a failure for the broker's own reasons.
func byBroker(callerStatus, agentStatus error) *failure {
	return &failure{by: brokerSide, callerStatus: callerStatus, agentStatus: agentStatus}
}

// statuses are the statuses that end the caller's and the agent's leg
// (nil: OK), as docs/protocol.md §4 gives them:
//
//	first failure                             caller's status   agent's status
//	none: both directions half-closed         OK                OK
//	the caller's leg (cancelled, gone)        Canceled          Canceled
//	the caller sent something but data        InvalidArgument   Canceled
//	the agent's leg, or it sent something
//	but data                                  Unavailable       Aborted
//	the broker's stop, the idle limit         the broker's, for each
//
// The caller's status names the tunnel by its id and says why in words,
// never with an address: kcp shows it to its end users. The agent's status,
// and the broker's log, keep the error as it was.
func (f *failure) statuses(id string) (callerStatus, agentStatus error) {
	switch {
	case f == nil:
		return nil, nil
	case f.by == brokerSide:
		return f.callerStatus, f.agentStatus
	case f.by == callerSide && status.Code(f.err) == codes.InvalidArgument:
		return f.err, status.Errorf(codes.Canceled, "caller broke the protocol: %v", f.err)
	case f.by == callerSide:
		return status.Error(codes.Canceled, "caller went away"),
			status.Errorf(codes.Canceled, "caller went away: %v", f.err)
	default:
		return status.Errorf(codes.Unavailable, "tunnel lost on the agent's side: %s (tunnel %s)", agentLoss(f.err), id),
			status.Errorf(codes.Aborted, "tunnel aborted: %v", f.err)
	}
}

// decide ends the tunnel with f (nil: cleanly), unless its end is decided
// already: Splice, waiting for it, then ends both legs.
func (t *Tunnel) decide(f *failure) {
	t.endMu.Lock()
	defer t.endMu.Unlock()
	if t.ended {
		return
	}
	t.ended, t.failure = true, f
	close(t.decided)
}

// watch fails the tunnel when either leg's peer goes away, when stopping
// ends, or when the tunnel has carried nothing for its idle limit, until
// unwatch. A peer may go away while neither direction waits on its leg: a
// caller that cancels while the up direction is blocked sending to an
// agent whose target does not read, say.
func (t *Tunnel) watch(stopping context.Context) (unwatch func()) {
	callerCtx, agentCtx := t.caller.Context(), t.agent.Context()
	// On contexts of the standard library, AfterFunc starts no goroutine
	// until its context ends.
	stopCaller := context.AfterFunc(callerCtx, func() { t.decide(&failure{by: callerSide, err: context.Cause(callerCtx)}) })
	stopAgent := context.AfterFunc(agentCtx, func() { t.decide(&failure{by: agentSide, err: context.Cause(agentCtx)}) })
	stopStopping := func() bool { return false }
	if stopping != nil {
		stopStopping = context.AfterFunc(stopping, func() {
			t.decide(byBroker(status.Error(codes.Unavailable, "the broker is shutting down and its grace period is over"),
				status.Error(codes.Unavailable, "the broker is shutting down")))
		})
	}
	t.startIdleTimer()
	return func() {
		stopCaller()
		stopAgent()
		stopStopping()
		t.stopIdleTimer()
	}
}

// maxLossText bounds what agentLoss passes on of an error it has no words
// for.
const maxLossText = 256

// agentLoss says in words why the agent's leg failed: its connection to
// the broker broke or closed, its stream was cancelled (the agent stopped,
// or lost its connection), or, redacted, what else the leg's error says.
// Go's network errors name both ends of the agent's connection
// ("read tcp 10.0.0.1:8443->10.0.0.7:42610: ..."), which a caller must not
// see.
func agentLoss(err error) string {
	var op *net.OpError
	var errno syscall.Errno
	switch {
	case errors.As(err, &errno):
		return "the agent's connection to the broker broke (" + errno.Error() + ")"
	case errors.As(err, &op), errors.Is(err, net.ErrClosed):
		return "the agent's connection to the broker broke"
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return "the agent's connection to the broker closed"
	case errors.Is(err, context.Canceled), status.Code(err) == codes.Canceled:
		return "the agent stopped, or lost its connection to the broker"
	}
	msg := status.Convert(err).Message()
	for _, cause := range []string{"connection reset by peer", "broken pipe", "connection timed out", "no route to host"} {
		if strings.Contains(msg, cause) {
			return "the agent's connection to the broker broke (" + cause + ")"
		}
	}
	if strings.Contains(msg, "transport is closing") || strings.Contains(msg, "EOF") {
		return "the agent's connection to the broker closed"
	}
	return redact.Text(msg, maxLossText)
}
