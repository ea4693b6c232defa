package tunnel

import (
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/internal/errinfo"
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
		return errinfo.Errorf(codes.Unavailable, errinfo.TunnelLost, "tunnel lost on the agent's side: %s (tunnel %s)", errinfo.AgentLoss(err), t.ID),
			status.Errorf(codes.Aborted, "tunnel aborted: %v", err)
	}
}
