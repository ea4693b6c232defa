package kcpplugin

import (
	"context"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	otelcodes "go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// scope is the instrumentation scope of kcpplugin's span.
const scope = "github.com/kcp-dev/tunnel-broker/kcpplugin"

// startDialSpan starts the span of a dial to target, "DialService", a child
// of the span in ctx: in kcp, the webhook call's. Its tracer provider is
// that span's, the one kcp traces with (as k8s.io/component-base/tracing
// does), or the global one when ctx holds no span; kcpplugin installs
// none. With neither, the span is OpenTelemetry's no-op: tracing off costs
// nothing to speak of.
func startDialSpan(ctx context.Context, target *tunnelv1.Target) (context.Context, trace.Span) {
	tp := otel.GetTracerProvider()
	if parent := trace.SpanFromContext(ctx); parent.SpanContext().IsValid() {
		tp = parent.TracerProvider()
	}
	return tp.Tracer(scope).Start(ctx, "DialService", trace.WithSpanKind(trace.SpanKindClient), trace.WithAttributes(
		attribute.String("tunnel.cluster", target.GetCluster()),
		attribute.String("tunnel.namespace", target.GetNamespace()),
		attribute.String("tunnel.service", target.GetService()),
		attribute.Int64("tunnel.port", int64(target.GetPort()))))
}

// withTraceContext is ctx with the W3C Trace Context of span in its
// outgoing gRPC metadata (docs/protocol.md §3.7), so that the broker's spans
// of the dial are children of span. W3C whatever global propagator kcp has:
// the format is the protocol's.
func withTraceContext(ctx context.Context, span trace.Span) context.Context {
	if !span.SpanContext().IsValid() {
		return ctx
	}
	fields := propagation.MapCarrier{}
	propagation.TraceContext{}.Inject(trace.ContextWithSpan(ctx, span), fields)
	kv := make([]string, 0, 2*len(fields))
	for k, v := range fields {
		kv = append(kv, k, v)
	}
	return metadata.AppendToOutgoingContext(ctx, kv...)
}

// endDialSpan ends a dial's span: established, with its tunnel's id, or
// failed with err.
func endDialSpan(span trace.Span, tunnelID string, err error) {
	if err != nil {
		st := status.Convert(err)
		span.SetAttributes(attribute.Int64("rpc.grpc.status_code", int64(st.Code())))
		span.SetStatus(otelcodes.Error, st.Code().String()+": "+st.Message())
	} else {
		span.SetAttributes(attribute.String("tunnel.id", tunnelID), attribute.Int64("rpc.grpc.status_code", 0))
	}
	span.End()
}
