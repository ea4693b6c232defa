// Package tracing puts the broker's and the agent's hops of a tunnel into
// the caller's OpenTelemetry trace: the spans each process starts, the
// exporter that sends them (OTLP over gRPC, off unless asked for), and the
// W3C Trace Context that carries a trace from one process to the next: in
// a Dial's gRPC metadata, a CONNECT's HTTP headers, and a DialOrder's
// trace_context (docs/protocol.md §3.7).
//
// Spans go to the global tracer provider. Until Setup installs one it is
// OpenTelemetry's no-op provider, whose spans cost a few nanoseconds and
// record nothing: tracing off is the default.
package tracing

import (
	"context"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/metadata"
)

// Scope is the instrumentation scope of every span of the broker and the
// agent.
const Scope = "github.com/kcp-dev/tunnel-broker"

// Tracer is the tracer of the broker's and the agent's spans.
func Tracer() trace.Tracer { return otel.Tracer(Scope) }

// propagator is W3C Trace Context, whatever global propagator the process
// has: it is part of the protocol (docs/protocol.md §3.7), not a choice of
// the deployment.
var propagator = propagation.TraceContext{}

// FromMetadata is ctx with the remote span context a gRPC caller sent in
// its metadata ("traceparent", "tracestate"), if it sent one.
func FromMetadata(ctx context.Context) context.Context {
	md, _ := metadata.FromIncomingContext(ctx)
	carrier := propagation.MapCarrier{}
	for _, k := range propagator.Fields() {
		if v := md.Get(k); len(v) > 0 {
			carrier[k] = v[0]
		}
	}
	return propagator.Extract(ctx, carrier)
}

// FromFields is ctx with the remote span context in fields, a DialOrder's
// trace_context, or an HTTP request's headers (propagation.HeaderCarrier).
func FromFields(ctx context.Context, fields propagation.TextMapCarrier) context.Context {
	return propagator.Extract(ctx, fields)
}

// Fields is ctx's span context as W3C Trace Context fields, for a
// DialOrder; nil when ctx holds no span context to pass on.
func Fields(ctx context.Context) map[string]string {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return nil
	}
	carrier := propagation.MapCarrier{}
	propagator.Inject(ctx, carrier)
	return carrier
}

// TraceID is the trace ctx's span belongs to, as 32 hex digits, or "" when
// ctx holds no span context: what the tunnel's log lines and its listing
// carry.
func TraceID(ctx context.Context) string {
	sc := trace.SpanContextFromContext(ctx)
	if !sc.IsValid() {
		return ""
	}
	return sc.TraceID().String()
}
