package registry

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/internal/errinfo"
	"github.com/kcp-dev/tunnel-broker/internal/redact"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// What a failed dial shows its caller, and what the broker logs.
//
// kcp shows a dial's error to its end users, in admission errors, and an
// agent's message comes from a peer the broker cannot trust. So the caller
// sees a short message in words: the agent by its name, never its SPIFFE
// ID, what it said with every address and URL taken out (package redact),
// and the tunnel id, under which the broker's log holds the rest.
const (
	// MaxAgentMessage bounds, in bytes, the part of an agent's
	// DialFailure.message that its caller sees.
	MaxAgentMessage = 256
	// MaxLoggedAgentMessage bounds, in bytes, what the broker logs of it.
	MaxLoggedAgentMessage = 8 << 10
	// maxAgentName bounds the agent's name in a caller's message.
	maxAgentName = 64
)

// DialError is a dial that failed after the broker ordered it. Its gRPC
// status is what the caller sees; LogAttrs is what the broker logs.
type DialError struct {
	TunnelID string
	Agent    *Agent
	// AgentMessage is the agent's DialFailure.message, cut to
	// MaxLoggedAgentMessage bytes, and AgentMessageBytes its whole
	// length; both are zero unless the agent reported the failure.
	AgentMessage      string
	AgentMessageBytes int
	// Earlier is the failure on another agent before this one, if the
	// dial was ordered twice (Registry.Dial).
	Earlier *DialError
	// EarlyDataSent: the agent said the order's early data reached the
	// target before it failed.
	EarlyDataSent bool
	status        *status.Status
}

func (e *DialError) Error() string { return e.status.Err().Error() }

// GRPCStatus makes the error its status for grpc-go and package status.
func (e *DialError) GRPCStatus() *status.Status { return e.status }

// LogAttrs are the tunnel id, the agent's name and SPIFFE ID, and what the
// agent said, as slog attributes.
func (e *DialError) LogAttrs() []any {
	attrs := []any{"tunnel", e.TunnelID, "agent", e.Agent.String()}
	if e.AgentMessageBytes > 0 {
		attrs = append(attrs, "agent_message", e.AgentMessage, "agent_message_bytes", e.AgentMessageBytes)
	}
	if e.Earlier != nil {
		attrs = append(attrs, slog.Group("earlier", e.Earlier.LogAttrs()...))
	}
	return attrs
}

// dialError is p's failure with code and reason (package errinfo), and
// message for its caller.
func dialError(p *pending, code codes.Code, reason, message string) *DialError {
	id := tunnelID(p.id)
	return &DialError{TunnelID: id, Agent: p.agent, status: errinfo.Newf(code, reason, "%s (tunnel %s)", message, id)}
}

// NoAgentError is a dial for a cluster that no agent serves on this
// replica. Nothing was ordered, and another replica may have an agent for
// it: one that has just started may not have every agent yet, and an agent
// may have lost only this replica.
type NoAgentError struct{ Cluster string }

func (e *NoAgentError) Error() string { return e.GRPCStatus().Err().Error() }

// GRPCStatus makes the error its status for grpc-go and package status.
func (e *NoAgentError) GRPCStatus() *status.Status {
	return errinfo.Newf(codes.Unavailable, errinfo.NoAgent, "no agent serves logical cluster %q", e.Cluster)
}

// tunnelID names a dial, and the tunnel it becomes, in messages and logs.
func tunnelID(dialID uint64) string { return fmt.Sprintf("%016x", dialID) }

// callerName names a to callers: by the name it registered with, redacted,
// never by its SPIFFE ID.
func callerName(a *Agent) string {
	if name := redact.Text(a.Name, maxAgentName); name != "" {
		return "agent " + name
	}
	return "the agent"
}

func agentGone(p *pending) error {
	return dialError(p, codes.Unavailable, errinfo.AgentGone, callerName(p.agent)+" went away")
}

func contextStatus(ctx context.Context, p *pending) error {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return dialError(p, codes.DeadlineExceeded, errinfo.AgentTimeout, callerName(p.agent)+" did not connect in time")
	}
	e := &DialError{TunnelID: tunnelID(p.id), Agent: p.agent, status: status.FromContextError(ctx.Err())}
	// A front end that ends a dial for its caller's mistake says why.
	if cause := context.Cause(ctx); cause != ctx.Err() {
		if s, ok := status.FromError(cause); ok {
			e.status = s
		}
	}
	return e
}

// agentFailure turns an agent's report into the caller's status. Only codes a
// caller can act on pass through; anything else means the agent failed.
func agentFailure(p *pending, f *tunnelv1.DialFailure) error {
	code := codes.Code(f.GetCode())
	switch code {
	case codes.NotFound, codes.Unavailable, codes.DeadlineExceeded, codes.PermissionDenied,
		codes.ResourceExhausted, codes.InvalidArgument, codes.FailedPrecondition:
	default:
		code = codes.Unavailable
	}
	said := redact.Text(f.GetMessage(), MaxAgentMessage)
	if said == "" {
		said = "no reason given"
	}
	e := dialError(p, code, errinfo.FromAgent(f.GetReason()), callerName(p.agent)+": "+said)
	e.AgentMessageBytes = len(f.GetMessage())
	e.EarlyDataSent = p.earlyOrdered && f.GetEarlyDataSent()
	e.AgentMessage = strings.ToValidUTF8(f.GetMessage()[:min(len(f.GetMessage()), MaxLoggedAgentMessage)], "")
	return e
}

// renamed is st with msg for its message, its code and reason kept: the
// second failure of a dial ordered twice (Registry.Dial), naming the first.
func renamed(st *status.Status, msg string) *status.Status { return errinfo.WithMessage(st, msg) }
