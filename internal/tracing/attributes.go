package tracing

import (
	"go.opentelemetry.io/otel/attribute"
	otelcodes "go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/status"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// Attribute keys of the broker's and the agent's spans (docs/operations.md,
// "Tracing").
const (
	TunnelID   = attribute.Key("tunnel.id")
	Caller     = attribute.Key("tunnel.caller")
	Frontend   = attribute.Key("tunnel.frontend")
	Agent      = attribute.Key("tunnel.agent")
	AgentCode  = attribute.Key("tunnel.agent_status_code")
	BytesUp    = attribute.Key("tunnel.bytes_up")
	BytesDown  = attribute.Key("tunnel.bytes_down")
	Endpoints  = attribute.Key("tunnel.endpoints")
	StatusCode = attribute.Key("rpc.grpc.status_code")
)

// TargetAttrs are a dial target's span attributes.
func TargetAttrs(t *tunnelv1.Target) []attribute.KeyValue {
	attrs := []attribute.KeyValue{
		attribute.String("tunnel.cluster", t.GetCluster()),
		attribute.Int64("tunnel.port", int64(t.GetPort())),
	}
	if t.GetIp() != "" {
		return append(attrs, attribute.String("tunnel.ip", t.GetIp()))
	}
	return append(attrs, attribute.String("tunnel.namespace", t.GetNamespace()), attribute.String("tunnel.service", t.GetService()))
}

// End ends span with err's gRPC status code as an attribute, and as the
// span's error for anything but OK.
func End(span trace.Span, err error, attrs ...attribute.KeyValue) {
	st := status.Convert(err)
	span.SetAttributes(append(attrs, StatusCode.Int64(int64(st.Code())))...)
	if err != nil {
		span.SetStatus(otelcodes.Error, st.Code().String()+": "+st.Message())
	}
	span.End()
}

// LogAttrs are the attributes of a log line that name span's trace: none
// when span has no valid span context.
func LogAttrs(span trace.Span) []any {
	if sc := span.SpanContext(); sc.IsValid() {
		return []any{"trace_id", sc.TraceID().String()}
	}
	return nil
}
