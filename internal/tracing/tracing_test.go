package tracing

import (
	"context"
	"net/http"
	"testing"

	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/metadata"
)

const (
	traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	traceID     = "4bf92f3577b34da6a3ce929d0e0e4736"
)

func TestACallersTraceContextInMetadataBecomesTheParent(t *testing.T) {
	ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs("traceparent", traceparent, "tracestate", "vendor=x"))
	sc := trace.SpanContextFromContext(FromMetadata(ctx))
	if !sc.IsRemote() || sc.TraceID().String() != traceID || sc.SpanID().String() != "00f067aa0ba902b7" || !sc.IsSampled() {
		t.Fatalf("span context %+v, want the caller's", sc)
	}
	if sc.TraceState().Get("vendor") != "x" {
		t.Errorf("tracestate %q, want vendor=x", sc.TraceState().String())
	}
}

func TestAMalformedTraceContextIsIgnored(t *testing.T) {
	for _, bad := range []string{"", "00-xyz", "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
		"00-00000000000000000000000000000000-00f067aa0ba902b7-01", string(make([]byte, 10000))} {
		ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs("traceparent", bad))
		if sc := trace.SpanContextFromContext(FromMetadata(ctx)); sc.IsValid() {
			t.Errorf("traceparent %.40q gave span context %+v, want none", bad, sc)
		}
	}
	if sc := trace.SpanContextFromContext(FromMetadata(context.Background())); sc.IsValid() {
		t.Errorf("no metadata gave span context %+v", sc)
	}
}

func TestACONNECTsHeadersCarryTheTraceContext(t *testing.T) {
	h := http.Header{}
	h.Set("Traceparent", traceparent)
	if id := TraceID(FromFields(context.Background(), propagation.HeaderCarrier(h))); id != traceID {
		t.Errorf("trace id %q, want %q", id, traceID)
	}
}

// The order's fields carry the span that is current, so that the agent's
// spans are its children; without a span there is nothing to carry.
func TestAnOrderCarriesTheCurrentSpan(t *testing.T) {
	if f := Fields(context.Background()); f != nil {
		t.Errorf("fields without a span: %v", f)
	}
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	ctx, span := tp.Tracer("test").Start(FromFields(context.Background(), propagation.MapCarrier{"traceparent": traceparent}), "dial")
	fields := Fields(ctx)
	span.End()
	got := trace.SpanContextFromContext(FromFields(context.Background(), propagation.MapCarrier(fields)))
	if got.TraceID().String() != traceID || got.SpanID() != span.SpanContext().SpanID() {
		t.Errorf("the order's span context %+v, want the dial span %+v", got, span.SpanContext())
	}
}

// With tracing off a caller's trace still names the tunnel: the no-op
// tracer's span keeps the caller's span context, and passes it on.
func TestWithTracingOffTheCallersTracePassesOn(t *testing.T) {
	ctx := FromFields(context.Background(), propagation.MapCarrier{"traceparent": traceparent})
	ctx, span := Tracer().Start(ctx, "tunnel")
	defer span.End()
	if span.IsRecording() {
		t.Fatal("the default tracer provider records spans: tracing is on by default")
	}
	if id := TraceID(ctx); id != traceID {
		t.Errorf("trace id %q, want the caller's %q", id, traceID)
	}
	if f := Fields(ctx); f["traceparent"] != traceparent {
		t.Errorf("the order's traceparent %q, want the caller's %q", f["traceparent"], traceparent)
	}
}

func TestTracingIsOnOnlyWithAnEndpoint(t *testing.T) {
	for _, tc := range []struct {
		endpoint, env, tracesEnv, disabled string
		want                               bool
	}{
		{want: false},
		{endpoint: "collector:4317", want: true},
		{env: "http://collector:4317", want: true},
		{tracesEnv: "http://collector:4317", want: true},
		{endpoint: "collector:4317", disabled: "true", want: false},
	} {
		t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", tc.env)
		t.Setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", tc.tracesEnv)
		t.Setenv("OTEL_SDK_DISABLED", tc.disabled)
		if got := (Config{Endpoint: tc.endpoint}).Enabled(); got != tc.want {
			t.Errorf("%+v: enabled %v, want %v", tc, got, tc.want)
		}
	}
}
