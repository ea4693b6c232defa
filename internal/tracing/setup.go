package tracing

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.37.0"
)

// Config says where a process sends its spans.
type Config struct {
	// Endpoint is the OTLP/gRPC receiver (a collector), host:port or a URL
	// (http:// for a receiver without TLS). Empty: the standard
	// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT,
	// and without either, tracing stays off.
	Endpoint string
	// Service is the process's service.name, unless OTEL_SERVICE_NAME
	// sets one: "tunnel-broker" or "syncer-agent".
	Service string
	// Version is the process's service.version.
	Version string
	// Log takes the exporter's errors (a receiver that is down).
	Log *slog.Logger
}

// Enabled reports whether cfg turns tracing on: an endpoint, by flag or by
// the standard environment, and the SDK not disabled (OTEL_SDK_DISABLED).
func (cfg Config) Enabled() bool {
	if strings.EqualFold(os.Getenv("OTEL_SDK_DISABLED"), "true") {
		return false
	}
	return cfg.Endpoint != "" || os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != "" || os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != ""
}

// Setup installs the global tracer provider that sends this process's
// spans by OTLP over gRPC, batched, when cfg turns tracing on; otherwise
// it leaves the no-op provider. The exporter and sampler read the other
// standard OTEL_* variables (headers, TLS, OTEL_TRACES_SAMPLER: by default
// a span is sampled when its parent is, and a root always). stop sends
// what is left, for at most flushTimeout.
func Setup(cfg Config) (stop func(), err error) {
	if !cfg.Enabled() {
		return func() {}, nil
	}
	var opts []otlptracegrpc.Option
	if cfg.Endpoint != "" {
		if strings.Contains(cfg.Endpoint, "://") {
			opts = append(opts, otlptracegrpc.WithEndpointURL(cfg.Endpoint))
		} else {
			opts = append(opts, otlptracegrpc.WithEndpoint(cfg.Endpoint))
		}
	}
	// New does not connect: a receiver that is down costs dropped spans
	// and a logged error, never a process that will not start.
	exporter, err := otlptracegrpc.New(context.Background(), opts...)
	if err != nil {
		return nil, fmt.Errorf("OTLP trace exporter: %w", err)
	}
	res, err := resource.Merge(resource.Default(), resource.NewSchemaless(
		semconv.ServiceName(cfg.Service), semconv.ServiceVersion(cfg.Version)))
	if err == nil {
		// OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win.
		var env *resource.Resource
		if env, err = resource.New(context.Background(), resource.WithFromEnv()); err == nil {
			res, err = resource.Merge(res, env)
		}
	}
	if err != nil && !errors.Is(err, resource.ErrSchemaURLConflict) {
		return nil, fmt.Errorf("OTEL_RESOURCE_ATTRIBUTES: %w", err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exporter), sdktrace.WithResource(res))
	otel.SetTracerProvider(tp)
	if cfg.Log != nil {
		log := cfg.Log
		otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) { log.Warn("tracing: spans not exported", "error", err) }))
	}
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), flushTimeout)
		defer cancel()
		if err := tp.Shutdown(ctx); err != nil && cfg.Log != nil {
			cfg.Log.Warn("tracing: spans not sent at exit", "error", err)
		}
	}, nil
}

// flushTimeout bounds how long a process that stops waits for its last
// spans to be sent.
const flushTimeout = 5 * time.Second

// AddFlags adds --otlp-endpoint, the same flag on the broker and the agent.
func (cfg *Config) AddFlags(fs *flag.FlagSet) {
	fs.StringVar(&cfg.Endpoint, "otlp-endpoint", "", "send OpenTelemetry spans of each tunnel to this OTLP/gRPC receiver (host:port, or http://host:port without TLS); empty: the standard OTEL_EXPORTER_OTLP_ENDPOINT, and without it tracing is off")
}
