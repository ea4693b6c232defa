package e2e

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/kcpplugin"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// TestTracingOneTraceFromTheWebhookCallToTheAgent sends an admission
// request through k8s.io/apiserver's webhook client, kcpplugin and the
// broker and agent binaries, each sending spans to one OTLP receiver, and
// finds one trace: the caller's span, the webhook dispatcher's, kcpplugin's
// dial under it, the broker's tunnel under that (its admission and dial),
// and the agent's order (its lookup and connect) under the broker's dial.
// The tunnel's id names it in tunnelctl tunnels --trace-ids and in both
// binaries' log lines.
func TestTracingOneTraceFromTheWebhookCallToTheAgent(t *testing.T) {
	env := harness.NewEnv(t)
	otlp := harness.StartOTLPReceiver(t)
	wh := harness.StartWebhook(t, harness.WebhookOptions{Namespace: "default", Name: "webhook"}, review)
	broker, brokerAddr := env.StartBrokerProcess("--otlp-endpoint", otlp.Endpoint)
	agent := env.StartAgentProcess(brokerAddr, "/agent/sync-target-1", lookup.StaticFile{Services: []lookup.StaticService{{
		Cluster: cluster, Namespace: "default", Name: "webhook", Ports: map[string]string{"443": wh.Addr},
	}}}, "--otlp-endpoint", otlp.Endpoint, "-v")

	// kcp's side: a tracer provider of its own, as kcp's
	// --tracing-config-file makes one, and the webhook call's span in the
	// admission request's context.
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	exporter, err := otlptracegrpc.New(ctx, otlptracegrpc.WithEndpointURL(otlp.Endpoint))
	if err != nil {
		t.Fatal(err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exporter),
		sdktrace.WithResource(resource.NewSchemaless(attribute.String("service.name", "kcp"))))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	dialer := &closingDialer{ServiceDialer: env.Dialer(brokerAddr, "/kcp")}
	svc := harness.WebhookService{Namespace: "default", Name: "webhook", Path: "/admit", Port: 443, CABundle: wh.CABundle}
	adm := harness.NewAdmission(t, harness.AdmissionOptions{Service: svc, Wrapper: kcpplugin.AuthInfoResolverWrapper(cluster, dialer)})

	callCtx, call := tp.Tracer("test").Start(ctx, "admission request")
	if _, err := adm.Admit(callCtx, configMap(nil)); err != nil {
		t.Fatal(err)
	}
	call.End()
	traceID := call.SpanContext().TraceID().String()
	out, err := tunnelctl(t, env, brokerAddr, "/operator", "tunnels", "--trace-ids").CombinedOutput()
	if err != nil || !strings.Contains(string(out), traceID) {
		t.Errorf("tunnelctl tunnels --trace-ids: %v\n%s\nwant the trace %s", err, out, traceID)
	}
	// The tunnel's span ends with the tunnel: close the webhook client's
	// kept-alive connection.
	dialer.closeAll()
	broker.WaitLogged(t, 1, "tunnel audit", traceID)
	if lines := agent.Logged("tunnel open", traceID); len(lines) == 0 {
		t.Errorf("no agent log line of the tunnel names its trace: %q", agent.Logged("tunnel"))
	}

	want := []struct{ service, name, parent string }{
		{"kcp", "admission request", ""},
		// k8s.io/apiserver's webhook dispatcher's span.
		{"kcp", "Call validating webhook", "admission request"},
		{"kcp", "DialService", "Call validating webhook"},
		{"tunnel-broker", "tunnel", "DialService"},
		{"tunnel-broker", "admission", "tunnel"},
		{"tunnel-broker", "dial", "tunnel"},
		{"syncer-agent", "order", "dial"},
		{"syncer-agent", "lookup", "order"},
		{"syncer-agent", "connect", "order"},
	}
	var spans []harness.Span
	byName := map[string]harness.Span{}
	harness.Eventually(t, 30*time.Second, "every span of the trace at the receiver", func() bool {
		spans = otlp.Trace(traceID)
		byName = map[string]harness.Span{}
		for _, s := range spans {
			byName[s.Name] = s
		}
		for _, w := range want {
			if _, ok := byName[w.name]; !ok {
				return false
			}
		}
		return true
	})
	for _, w := range want {
		s := byName[w.name]
		if s.Service != w.service {
			t.Errorf("span %q came from %q, want %q", w.name, s.Service, w.service)
		}
		if s.Error {
			t.Errorf("span %q ended with an error: %s", w.name, s.StatusMessage)
		}
		wantParent := ""
		if w.parent != "" {
			wantParent = byName[w.parent].SpanID
		}
		if s.ParentSpanID != wantParent {
			t.Errorf("span %q's parent is %s, want %q's (%s)", w.name, s.ParentSpanID, w.parent, wantParent)
		}
	}
	if len(spans) != len(want) {
		t.Errorf("the trace has %d spans, want %d: %+v", len(spans), len(want), spans)
	}
	tunnel, dial := byName["tunnel"], byName["DialService"]
	if tunnel.Attributes["tunnel.id"] == "" || tunnel.Attributes["tunnel.id"] != dial.Attributes["tunnel.id"] ||
		tunnel.Attributes["tunnel.id"] != byName["order"].Attributes["tunnel.id"] {
		t.Errorf("tunnel ids: kcpplugin %q, broker %q, agent %q", dial.Attributes["tunnel.id"], tunnel.Attributes["tunnel.id"], byName["order"].Attributes["tunnel.id"])
	}
	for _, attr := range []string{"tunnel.cluster", "tunnel.namespace", "tunnel.service", "tunnel.port"} {
		if tunnel.Attributes[attr] == "" || tunnel.Attributes[attr] != byName["order"].Attributes[attr] {
			t.Errorf("%s: broker %q, agent %q", attr, tunnel.Attributes[attr], byName["order"].Attributes[attr])
		}
	}
	if tunnel.Attributes["rpc.grpc.status_code"] != "0" || tunnel.Attributes["tunnel.bytes_up"] == "0" {
		t.Errorf("the tunnel's end: %v", tunnel.Attributes)
	}
	if !tunnel.End.After(byName["admission request"].End) {
		t.Errorf("the tunnel's span ended at %v, before the call that opened it (%v): it should last the tunnel's life",
			tunnel.End, byName["admission request"].End)
	}
	if events := byName["dial"].Events; len(events) != 1 || events[0] != "order sent" {
		t.Errorf("the broker's dial span's events: %q, want [order sent]", events)
	}
}

// closingDialer remembers the connections it dials, so that a test can
// close those the webhook client keeps alive.
type closingDialer struct {
	kcpplugin.ServiceDialer
	mu    sync.Mutex
	conns []net.Conn
}

func (d *closingDialer) DialService(ctx context.Context, cluster, namespace, name string, port int32) (net.Conn, error) {
	c, err := d.ServiceDialer.DialService(ctx, cluster, namespace, name, port)
	if err == nil {
		d.mu.Lock()
		d.conns = append(d.conns, c)
		d.mu.Unlock()
	}
	return c, err
}

func (d *closingDialer) closeAll() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, c := range d.conns {
		_ = c.Close()
	}
}

// startTracedFrontEnds runs the broker binary with both front ends, as
// startFrontEnds does, and an agent serving echo (port 80) and a port
// that refuses (81), both sending spans to a receiver it returns.
func startTracedFrontEnds(t *testing.T, env *harness.Env) (otlp *harness.OTLPReceiver, addr, egress string) {
	t.Helper()
	otlp = harness.StartOTLPReceiver(t)
	broker, addr := env.StartBrokerProcess("--log-json", "--policy", egressCallerPolicy(t, env), "--egress-listen", "127.0.0.1:0",
		"--otlp-endpoint", otlp.Endpoint)
	line := broker.WaitLogged(t, 1, `"msg":"egress front end serving"`, `"frontend":"tls"`)[0]
	var serving struct{ Address string }
	if err := json.Unmarshal([]byte(line), &serving); err != nil || serving.Address == "" {
		t.Fatalf("the CONNECT front end's address in %s: %v", line, err)
	}
	services := echoServices(harness.StartEcho(t))
	services.Services[0].Ports["81"] = closedPort(t)
	env.StartAgentProcess(addr, "/agent/sync-target-1", services, "--otlp-endpoint", otlp.Endpoint)
	return otlp, addr, serving.Address
}

// waitSpans waits until the receiver holds a span of each name in trace
// id, and returns them by name.
func waitSpans(t *testing.T, otlp *harness.OTLPReceiver, id string, names ...string) map[string]harness.Span {
	t.Helper()
	byName := map[string]harness.Span{}
	harness.Eventually(t, 30*time.Second, "spans "+strings.Join(names, ", ")+" at the receiver", func() bool {
		for _, s := range otlp.Trace(id) {
			byName[s.Name] = s
		}
		for _, n := range names {
			if _, ok := byName[n]; !ok {
				return false
			}
		}
		return true
	})
	return byName
}

// TestTracingAFailedDialShowsWhereItFailed dials a port that refuses: the
// agent's connect span, its order, the broker's dial and tunnel and
// kcpplugin's dial end with the error, the lookup and admission without.
func TestTracingAFailedDialShowsWhereItFailed(t *testing.T) {
	env := harness.NewEnv(t)
	otlp, addr, _ := startTracedFrontEnds(t, env)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	exporter, err := otlptracegrpc.New(ctx, otlptracegrpc.WithEndpointURL(otlp.Endpoint))
	if err != nil {
		t.Fatal(err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exporter))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	ctx, call := tp.Tracer("test").Start(ctx, "webhook call")
	dialer := env.Dialer(addr, "/kcp")
	dialer.EarlyData = false
	if _, err := dialer.DialService(ctx, "root", "default", "echo", 81); status.Code(err) != codes.Unavailable {
		t.Fatalf("dial of a port that refuses: %v, want Unavailable", err)
	}
	call.End()
	spans := waitSpans(t, otlp, call.SpanContext().TraceID().String(), "DialService", "tunnel", "admission", "dial", "order", "lookup", "connect")
	for name, failed := range map[string]bool{"DialService": true, "tunnel": true, "admission": false, "dial": true, "order": true, "lookup": false, "connect": true} {
		s := spans[name]
		if s.Error != failed {
			t.Errorf("span %q: error %v (%q), want %v", name, s.Error, s.StatusMessage, failed)
		}
		if failed && (s.Attributes["rpc.grpc.status_code"] != strconv.Itoa(int(codes.Unavailable)) || !strings.Contains(s.StatusMessage, "connection refused")) {
			t.Errorf("span %q: code %s, message %q; want Unavailable, connection refused", name, s.Attributes["rpc.grpc.status_code"], s.StatusMessage)
		}
		if strings.Contains(s.StatusMessage, "127.0.0.1") {
			t.Errorf("span %q's message names an address: %q", name, s.StatusMessage)
		}
	}
}

// TestTracingACONNECTTakesItsCallersTraceparent: a CONNECT's tunnel span
// is a child of the span its traceparent header names, and a root of its
// own without one (kube-apiserver sends none).
func TestTracingACONNECTTakesItsCallersTraceparent(t *testing.T) {
	env := harness.NewEnv(t)
	otlp, _, egress := startTracedFrontEnds(t, env)
	const traceID, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	for _, header := range []string{"Traceparent: 00-" + traceID + "-" + parent + "-01\r\n", ""} {
		src := env.Identity("/kcp")
		conn, err := tls.Dial("tcp", egress, tlsconfig.MTLSClientConfig(src, src, tlsconfig.AuthorizeID(harness.ID("/broker"))))
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(conn, "CONNECT echo.default.svc:80 HTTP/1.1\r\nHost: echo.default.svc:80\r\n%s\r\n", header)
		br := bufio.NewReader(conn)
		resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("CONNECT: %v %v", resp, err)
		}
		roundTrip(t, &connectConn{Conn: conn, r: br}, "CONNECT")
		conn.Close()
	}
	spans := waitSpans(t, otlp, traceID, "tunnel", "admission", "dial", "order")
	if s := spans["tunnel"]; s.ParentSpanID != parent || s.Attributes["tunnel.frontend"] != "CONNECT" {
		t.Errorf("the CONNECT's tunnel span: parent %s, front end %q; want %s, CONNECT", s.ParentSpanID, s.Attributes["tunnel.frontend"], parent)
	}
	harness.Eventually(t, 30*time.Second, "the CONNECT without a traceparent to have a trace of its own", func() bool {
		for _, s := range otlp.Spans() {
			if s.Name == "tunnel" && s.TraceID != traceID && s.ParentSpanID == "" && s.Attributes["tunnel.frontend"] == "CONNECT" {
				return true
			}
		}
		return false
	})
}

// TestTracingToACollectorThatIsDownLosesNoDial: the broker and the agent
// send spans to an address whose connects never complete, and every dial
// of a traced caller still goes through at once; the spans are what is
// lost.
func TestTracingToACollectorThatIsDownLosesNoDial(t *testing.T) {
	env := harness.NewEnv(t)
	down := "http://" + harness.StartUnanswered(t)
	_, addr := env.StartBrokerProcess("--otlp-endpoint", down)
	env.StartAgentProcess(addr, "/agent/sync-target-1", echoServices(harness.StartEcho(t)), "--otlp-endpoint", down)
	tp := sdktrace.NewTracerProvider() // records spans, exports nowhere: the caller traces
	defer func() { _ = tp.Shutdown(context.Background()) }()
	dialer := env.Dialer(addr, "/kcp")
	dialer.EarlyData = false
	for i := range 50 {
		ctx, span := tp.Tracer("test").Start(context.Background(), "webhook call")
		conn, err := dialer.DialService(ctx, "root", "default", "echo", 80)
		span.End()
		if err != nil {
			t.Fatalf("dial %d with the collector down: %v", i, err)
		}
		roundTrip(t, conn, fmt.Sprintf("dial %d", i))
		conn.Close()
	}
}
