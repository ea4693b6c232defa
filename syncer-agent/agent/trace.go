package agent

import (
	"context"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/kcp-dev/tunnel-broker/internal/tracing"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// The agent's spans of a dial (docs/operations.md, "Tracing"), children of
// the broker's dial span, whose context the order carries:
//
//	order      the order, from its arrival until the tunnel's stream is
//	│          open or the broker is told why not
//	├── lookup     the Service's endpoints (the resolver)
//	└── connect    TCP to the first endpoint that accepts
const (
	spanOrder   = "order"
	spanLookup  = "lookup"
	spanConnect = "connect"
)

// startOrderSpan starts order's span, a child of the trace context it
// carries, if any.
func startOrderSpan(ctx context.Context, order *tunnelv1.DialOrder) (context.Context, trace.Span) {
	ctx = tracing.FromFields(ctx, propagation.MapCarrier(order.GetTraceContext()))
	return tracing.Tracer().Start(ctx, spanOrder, trace.WithSpanKind(trace.SpanKindServer),
		trace.WithAttributes(append(tracing.TargetAttrs(order.GetTarget()), tracing.TunnelID.String(tunnelID(order.GetDialId())))...))
}
