package harness

import (
	"context"
	"encoding/hex"
	"net"
	"strconv"
	"sync"
	"time"

	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonv1 "go.opentelemetry.io/proto/otlp/common/v1"
	"google.golang.org/grpc"
)

// OTLPReceiver is an OpenTelemetry collector's trace receiver, OTLP over
// gRPC without TLS on a loopback port: what the broker's and the agent's
// --otlp-endpoint, and a test's own exporter, send spans to.
type OTLPReceiver struct {
	collectortrace.UnimplementedTraceServiceServer

	// Addr is host:port; Endpoint the URL the binaries take.
	Addr, Endpoint string

	mu    sync.Mutex
	spans []Span
}

// Span is one span a receiver got, with the service.name of the process
// that sent it.
type Span struct {
	Service             string
	Name                string
	TraceID, SpanID     string
	ParentSpanID        string
	Attributes          map[string]string
	Error               bool
	StatusMessage       string
	Start, End          time.Time
	Events              []string
	InstrumentationName string
}

// StartOTLPReceiver serves a receiver until the test ends.
func StartOTLPReceiver(t T) *OTLPReceiver {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &OTLPReceiver{Addr: l.Addr().String(), Endpoint: "http://" + l.Addr().String()}
	srv := grpc.NewServer()
	collectortrace.RegisterTraceServiceServer(srv, r)
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(srv.Stop)
	return r
}

// Export implements the collector's TraceService.
func (r *OTLPReceiver) Export(_ context.Context, req *collectortrace.ExportTraceServiceRequest) (*collectortrace.ExportTraceServiceResponse, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, rs := range req.GetResourceSpans() {
		service := ""
		for _, a := range rs.GetResource().GetAttributes() {
			if a.GetKey() == "service.name" {
				service = a.GetValue().GetStringValue()
			}
		}
		for _, ss := range rs.GetScopeSpans() {
			for _, s := range ss.GetSpans() {
				span := Span{
					Service: service, Name: s.GetName(),
					TraceID: hex.EncodeToString(s.GetTraceId()), SpanID: hex.EncodeToString(s.GetSpanId()),
					ParentSpanID: hex.EncodeToString(s.GetParentSpanId()), Attributes: map[string]string{},
					Error: s.GetStatus().GetCode() == 2, StatusMessage: s.GetStatus().GetMessage(),
					Start: time.Unix(0, int64(s.GetStartTimeUnixNano())), End: time.Unix(0, int64(s.GetEndTimeUnixNano())),
					InstrumentationName: ss.GetScope().GetName(),
				}
				for _, a := range s.GetAttributes() {
					switch v := a.GetValue().GetValue().(type) {
					case *commonv1.AnyValue_StringValue:
						span.Attributes[a.GetKey()] = v.StringValue
					case *commonv1.AnyValue_IntValue:
						span.Attributes[a.GetKey()] = strconv.FormatInt(v.IntValue, 10)
					default:
						span.Attributes[a.GetKey()] = a.GetValue().String()
					}
				}
				for _, e := range s.GetEvents() {
					span.Events = append(span.Events, e.GetName())
				}
				r.spans = append(r.spans, span)
			}
		}
	}
	return &collectortrace.ExportTraceServiceResponse{}, nil
}

// Trace is every span received so far of trace id.
func (r *OTLPReceiver) Trace(id string) []Span {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []Span
	for _, s := range r.spans {
		if s.TraceID == id {
			out = append(out, s)
		}
	}
	return out
}

// Spans is every span received so far.
func (r *OTLPReceiver) Spans() []Span {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Span(nil), r.spans...)
}
