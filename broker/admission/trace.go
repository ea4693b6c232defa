package admission

import (
	"context"

	"go.opentelemetry.io/otel/trace"

	"github.com/kcp-dev/tunnel-broker/internal/tracing"
)

// The broker's spans of a tunnel (docs/operations.md, "Tracing"):
//
//	tunnel             from Hold to the tunnel's end: how long it lived
//	├── admission      the target, the policy, the early data's bound
//	└── dial           ordering an agent and waiting for its Tunnel;
//	                   the agent's spans are children of this one
const (
	spanTunnel    = "tunnel"
	spanAdmission = "admission"
	spanDial      = "dial"
)

// startTunnelSpan starts a tunnel's span, a child of the span context the
// caller sent, which the front end put in ctx, if it sent one.
func startTunnelSpan(ctx context.Context, caller Caller) (context.Context, trace.Span) {
	return tracing.Tracer().Start(ctx, spanTunnel, trace.WithSpanKind(trace.SpanKindServer),
		trace.WithAttributes(tracing.Caller.String(caller.String()), tracing.Frontend.String(caller.Frontend)))
}
