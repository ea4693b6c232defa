package tunnel

import (
	"context"
	"errors"
	"io"
	"net"
	"syscall"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/internal/errinfo"
	"github.com/kcp-dev/tunnel-broker/internal/redact"
	"github.com/kcp-dev/tunnel-broker/internal/splice"
)

// brokerEnd is the broker's own reason to end a tunnel (its stop, the
// idle limit), as the cause of the splice's Stop, with the status of each
// leg.
type brokerEnd struct{ callerStatus, agentStatus error }

func (e *brokerEnd) Error() string { return status.Convert(e.callerStatus).Message() }

// errStopping ends the tunnels still open when the broker's grace period
// is over.
var errStopping = &brokerEnd{
	errinfo.Error(codes.Unavailable, errinfo.BrokerStopping, "the broker is shutting down and its grace period is over"),
	errinfo.Error(codes.Unavailable, errinfo.BrokerStopping, "the broker is shutting down"),
}

// CallerSentNotData is the failure of a caller that sends anything but data
// after its target.
func CallerSentNotData() error {
	return status.Error(codes.InvalidArgument, "protocol error: after the target, a caller may only send non-empty data")
}

var errAgentSentNotData = errors.New("protocol error: after opening, an agent may only send non-empty data")

// statuses are the statuses that end the caller's leg (A) and the agent's
// (B) for the splice's failure f (nil: OK), as docs/protocol.md §4 gives
// them:
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
func (t *Tunnel) statuses(f *splice.Failure) (callerStatus, agentStatus error) {
	if f == nil {
		return nil, nil
	}
	err := f.Err
	if end, ok := errors.AsType[*brokerEnd](err); ok && f.By == splice.Neither {
		return end.callerStatus, end.agentStatus
	}
	if errors.Is(err, splice.ErrNotData) {
		err = CallerSentNotData()
		if f.By == splice.B {
			err = errAgentSentNotData
		}
	}
	switch {
	case f.By == splice.A && status.Code(err) == codes.InvalidArgument:
		return err, status.Errorf(codes.Canceled, "caller broke the protocol: %v", err)
	case f.By == splice.A:
		return status.Error(codes.Canceled, "caller went away"),
			status.Errorf(codes.Canceled, "caller went away: %v", err)
	default:
		return errinfo.Errorf(codes.Unavailable, errinfo.TunnelLost, "tunnel lost on the agent's side: %s (tunnel %s)", agentLoss(err), t.ID),
			status.Errorf(codes.Aborted, "tunnel aborted: %v", err)
	}
}

// maxLossText bounds what agentLoss passes on of an error it has no words
// for.
const maxLossText = 256

// agentLoss says in words why the agent's leg failed, by the error's type
// and status code, never its text: its connection to the broker broke or
// closed, its stream was cancelled (the agent stopped, or lost its
// connection), or, redacted, what else the leg's error says. Go's network
// errors name both ends of the agent's connection
// ("read tcp 10.0.0.1:8443->10.0.0.7:42610: ..."), which a caller must not
// see; gRPC passes a broken transport on as Unavailable, with the cause
// only in its text, which the broker's log keeps.
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
	case status.Code(err) == codes.Unavailable:
		return "the agent's connection to the broker broke or closed"
	}
	return redact.Text(status.Convert(err).Message(), maxLossText)
}
