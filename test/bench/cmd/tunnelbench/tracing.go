package main

import (
	"context"
	"fmt"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.37.0"

	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// startTracing, for -trace, serves an OTLP receiver in this process, for
// the broker and the agent (--otlp-endpoint) and kcpplugin, which traces
// with the global tracer provider, batched as kcp's would be: its span is
// each dial's root.
func (r *runner) startTracing() *harness.OTLPReceiver {
	receiver := harness.StartOTLPReceiver(r.m)
	exporter, err := otlptracegrpc.New(context.Background(), otlptracegrpc.WithEndpointURL(receiver.Endpoint))
	if err != nil {
		r.m.Fatal(err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exporter),
		sdktrace.WithResource(resource.NewSchemaless(semconv.ServiceName("kcp"))))
	otel.SetTracerProvider(tp)
	r.m.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return receiver
}

// spansReceived says how many spans each service sent, with -trace.
func (r *runner) spansReceived() string {
	if r.otlp == nil {
		return "tracing off"
	}
	count := map[string]int{}
	for _, s := range r.otlp.Spans() {
		count[s.Service]++
	}
	return fmt.Sprintf("spans received: kcpplugin %d, broker %d, agent %d", count["kcp"], count["tunnel-broker"], count["syncer-agent"])
}
