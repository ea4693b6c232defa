// Package errinfo is the root module's one home of what its errors say:
// the reasons its statuses carry, a google.rpc.ErrorInfo detail with a
// stable Reason in Domain, which a client reads with Of instead of
// matching a status's message; and the words for network errors, by type
// (words.go). The broker attaches them (New, Error); tunnelctl chooses its
// hints by them; docs/protocol.md §5 lists them, since clients may rely on
// them. A message is for people and may change; a reason may not.
//
// It is its own package, below the broker's packages and tunnelctl, so
// that both import the same names without tunnelctl importing the
// broker.
package errinfo

import (
	"fmt"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Domain is the ErrorInfo.domain of every reason here.
const Domain = "tunnel.kcp.io"

// The reasons, as docs/protocol.md §5 gives them. Add to them; never
// rename or reuse one.
const (
	// NoAgent (Unavailable): no agent serves the dial's logical cluster on
	// this broker replica; another replica may have one.
	NoAgent = "NO_AGENT"
	// ReplicaDraining (Unavailable): this broker replica is shutting down
	// and takes no more dials; another replica may.
	ReplicaDraining = "REPLICA_DRAINING"
	// AgentGone (Unavailable): the agent the dial was ordered to went
	// away (its Connect ended) before it answered.
	AgentGone = "AGENT_GONE"
	// AgentTimeout (DeadlineExceeded): the agent did not open the tunnel
	// within the broker's dial timeout or the caller's deadline.
	AgentTimeout = "AGENT_TIMEOUT"
	// AgentDialFailed (the agent's code: NotFound, Unavailable,
	// DeadlineExceeded, PermissionDenied, ...; Unavailable for any code
	// the broker does not pass through): the agent reported that it could
	// not connect the dial; the message says why, in the agent's words.
	AgentDialFailed = "AGENT_DIAL_FAILED"
	// NoEndpoints (Unavailable): the agent found the dial's Service, but
	// it has no ready endpoints. Sent by the agent (DialFailure.reason).
	NoEndpoints = "NO_ENDPOINTS"
	// TargetRefused (Unavailable): the agent reached the Service's
	// endpoints, but their port refused the connection. Sent by the agent.
	TargetRefused = "TARGET_REFUSED"
	// TargetUnreachable (Unavailable): the agent could not reach the
	// Service's endpoints (no route, unreachable, reset). Sent by the agent.
	TargetUnreachable = "TARGET_UNREACHABLE"
	// TunnelLost (Unavailable): after established, the tunnel was lost on
	// the agent's side (its connection broke or closed, or it stopped).
	TunnelLost = "TUNNEL_LOST"
	// BrokerStopping (Unavailable): the broker's grace period at shutdown
	// is over and it ended the tunnel.
	BrokerStopping = "BROKER_STOPPING"
	// IdleTimeout (DeadlineExceeded): the tunnel carried nothing for the
	// broker's --idle-timeout.
	IdleTimeout = "IDLE_TIMEOUT"
)

// New is a status with code, msg and reason as its ErrorInfo.
func New(code codes.Code, reason, msg string) *status.Status {
	st := status.New(code, msg)
	if withInfo, err := st.WithDetails(&errdetails.ErrorInfo{Reason: reason, Domain: Domain}); err == nil {
		return withInfo
	}
	return st // only for OK, which has no reason
}

// Newf is New with a formatted message.
func Newf(code codes.Code, reason, format string, args ...any) *status.Status {
	return New(code, reason, fmt.Sprintf(format, args...))
}

// FromAgent is the reason the broker passes on for an agent's
// DialFailure.reason: one of those an agent may send, or AgentDialFailed
// for anything else (an agent's word is not trusted to be one of ours).
func FromAgent(reason string) string {
	switch reason {
	case NoEndpoints, TargetRefused, TargetUnreachable:
		return reason
	}
	return AgentDialFailed
}

// Error is New as an error.
func Error(code codes.Code, reason, msg string) error { return New(code, reason, msg).Err() }

// Errorf is Newf as an error.
func Errorf(code codes.Code, reason, format string, args ...any) error {
	return Newf(code, reason, format, args...).Err()
}

// WithMessage is st with msg for its message, its code and details (its
// reason) kept.
func WithMessage(st *status.Status, msg string) *status.Status {
	p := st.Proto()
	p.Message = msg
	return status.FromProto(p)
}

// Of is the reason err's status carries in Domain, or "" if it has none
// (it is not a status, or not one of ours).
func Of(err error) string {
	st, ok := status.FromError(err)
	if !ok {
		return ""
	}
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok && info.GetDomain() == Domain {
			return info.GetReason()
		}
	}
	return ""
}
