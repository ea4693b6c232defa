package egress

import (
	"bufio"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	promtestutil "github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	"github.com/kcp-dev/tunnel-broker/broker/admission"
	agentv1 "github.com/kcp-dev/tunnel-broker/broker/api/agent/v1"
	"github.com/kcp-dev/tunnel-broker/broker/authz"
	"github.com/kcp-dev/tunnel-broker/broker/internal/brokertest"
	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
	"github.com/kcp-dev/tunnel-broker/internal/devca"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// The tests run the front end over real sockets (a Unix socket, and TCP
// with SPIFFE mTLS from brokertest's throwaway CA) in front of brokertest's
// real gRPC broker, and play the agent by hand with the generated clients.

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const (
	agentPath     = "/agent"
	apiServerPath = "/hcp-1/kube-apiserver" // egress to hcp-1
	strangerPath  = "/stranger"             // no egress rule
)

var testPolicy = policy.File{
	Agents:  []policy.AgentRule{{ID: brokertest.ID(agentPath).String(), Clusters: []string{"*"}}},
	Callers: []policy.CallerRule{{ID: brokertest.ID("/kcp").String()}},
	Egress:  []policy.EgressRule{{ID: brokertest.ID(apiServerPath).String(), Cluster: "hcp-1"}},
}

// frontEnd is a broker with one front end serving on addr.
type frontEnd struct {
	*brokertest.Server
	addr, network string
	tls           bool
}

func startBroker(t *testing.T) *brokertest.Server {
	t.Helper()
	return brokertest.Start(t, testPolicy, func(s *brokertest.Server, srv *grpc.Server) {
		agentv1.RegisterService(srv, agentv1.New(agentv1.Config{
			Registry: s.Registry, Policy: s.Policy, BrokerID: "test-broker",
			Draining: s.Draining, Stopping: s.Stopping, Grace: time.Second,
			ProbeEvery: time.Hour, Log: s.Log,
		}))
	})
}

// serve runs a front end with cfg, completed from b, on l until the test ends.
func serve(t *testing.T, b *brokertest.Server, cfg Config, l net.Listener) {
	t.Helper()
	if cfg.Timeout == 0 {
		cfg.Timeout = testutil.WaitLong
	}
	cfg.Policy, cfg.Log = b.Policy, b.Log
	if cfg.Admission == nil {
		cfg.Admission = admission.New(admission.Config{Registry: b.Registry, Policy: b.Policy, Log: b.Log, Draining: b.Draining,
			Tunnels: tunnel.Config{Stopping: b.Stopping}, Timeout: cfg.Timeout})
	}
	s := New(cfg)
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- s.Serve(ctx, l) }()
	t.Cleanup(func() {
		b.Stop() // ends the tunnels still open
		cancel()
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
}

// startUDS is a broker with a plain front end for cluster on a Unix socket.
func startUDS(t *testing.T, cluster string) *frontEnd {
	t.Helper()
	b := startBroker(t)
	path := filepath.Join(t.TempDir(), "egress.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	serve(t, b, Config{Name: "uds", Cluster: cluster}, l)
	return &frontEnd{Server: b, addr: path, network: "unix"}
}

// startTLS is a broker with a SPIFFE mTLS front end on loopback.
func startTLS(t *testing.T) *frontEnd {
	t.Helper()
	return serveTLS(t, startBroker(t), nil)
}

// serveTLS serves a SPIFFE mTLS front end of b on loopback, admitting
// through door (nil: a front door of b's with the defaults).
func serveTLS(t *testing.T, b *brokertest.Server, door *admission.Admission) *frontEnd {
	t.Helper()
	return serveTLSWith(t, b, Config{Admission: door})
}

// serveTLSWith is serveTLS with cfg, whose TLS server has opts.
func serveTLSWith(t *testing.T, b *brokertest.Server, cfg Config, opts ...identity.Option) *frontEnd {
	t.Helper()
	src, err := b.CA.Source(devca.Leaf{SPIFFEID: brokertest.BrokerPath})
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cfg.Name, cfg.TLS = "tls", identity.NewTLSServer(src, opts...)
	serve(t, b, cfg, l)
	return &frontEnd{Server: b, addr: l.Addr().String(), network: "tcp", tls: true}
}

// connect opens a connection as the identity path (TLS only) and sends
// request.
func (f *frontEnd) connect(t *testing.T, path, request string) (net.Conn, *bufio.Reader) {
	t.Helper()
	conn, err := net.DialTimeout(f.network, f.addr, testutil.WaitLong)
	if err != nil {
		t.Fatal(err)
	}
	if f.tls {
		cfg := f.ClientTLS(t, path)
		cfg.NextProtos = nil
		conn = tls.Client(conn, cfg)
	}
	t.Cleanup(func() { conn.Close() })
	_ = conn.SetDeadline(time.Now().Add(testutil.WaitLong))
	if _, err := io.WriteString(conn, request); err != nil {
		t.Fatal(err)
	}
	return conn, bufio.NewReader(conn)
}

// answer reads the answer to a CONNECT.
func answer(t *testing.T, r *bufio.Reader) (int, string) {
	t.Helper()
	resp, err := http.ReadResponse(r, &http.Request{Method: http.MethodConnect})
	if err != nil {
		t.Fatalf("reading the answer: %v", err)
	}
	if resp.StatusCode == http.StatusOK {
		return resp.StatusCode, ""
	}
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, strings.TrimSpace(string(body))
}

func connectTo(authority string) string {
	return fmt.Sprintf("CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", authority, authority)
}

// roundTrip checks that bytes pass both ways through an established
// CONNECT and its agent's tunnel, and that half-closes pass too.
func roundTrip(t *testing.T, conn net.Conn, r *bufio.Reader, tun tunnelv1.AgentService_TunnelClient) {
	t.Helper()
	if _, err := io.WriteString(conn, "ping"); err != nil {
		t.Fatal(err)
	}
	if msg, err := tun.Recv(); err != nil || string(msg.GetData()) != "ping" {
		t.Fatalf("agent got %v, %v; want ping", msg, err)
	}
	if err := tun.Send(brokertest.DataDown([]byte("pong"))); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	if _, err := io.ReadFull(r, buf); err != nil || string(buf) != "pong" {
		t.Fatalf("client got %q, %v; want pong", buf, err)
	}
	if err := tun.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if _, err := r.ReadByte(); err != io.EOF {
		t.Fatalf("after the agent's half-close the client read %v, want EOF", err)
	}
	if cw, ok := conn.(interface{ CloseWrite() error }); ok {
		if err := cw.CloseWrite(); err != nil {
			t.Fatal(err)
		}
	}
	for {
		msg, err := tun.Recv()
		if err != nil {
			if err != io.EOF {
				t.Fatalf("agent's tunnel ended with %v, want OK", err)
			}
			return
		}
		if msg.GetCloseWrite() == nil {
			t.Fatalf("agent got %v, want close_write", msg)
		}
	}
}

func TestConnectOverUDSReachesTheServiceOfTheSocketsCluster(t *testing.T) {
	f := startUDS(t, "hcp-1")
	agent := f.ConnectAgent(t, agentPath, "agent", "hcp-1")
	for _, c := range []struct {
		authority string
		want      *tunnelv1.Target
	}{
		{"10.96.0.10:443", &tunnelv1.Target{Cluster: "hcp-1", Ip: "10.96.0.10", Port: 443}},
		{"[fd00::a]:8443", &tunnelv1.Target{Cluster: "hcp-1", Ip: "fd00::a", Port: 8443}},
		{"webhook.default.svc:443", &tunnelv1.Target{Cluster: "hcp-1", Namespace: "default", Service: "webhook", Port: 443}},
		{"webhook.default.svc.cluster.local:443", &tunnelv1.Target{Cluster: "hcp-1", Namespace: "default", Service: "webhook", Port: 443}},
	} {
		t.Run(c.authority, func(t *testing.T) {
			conn, r := f.connect(t, "", connectTo(c.authority))
			order := agent.Order(t, c.want)
			tun, _ := agent.Open(t, order.GetDialId())
			if code, body := answer(t, r); code != http.StatusOK {
				t.Fatalf("answer %d %s, want 200", code, body)
			}
			roundTrip(t, conn, r, tun)
		})
	}
}

func TestConnectOverMTLSGoesToTheCallersCluster(t *testing.T) {
	f := startTLS(t)
	agent := f.ConnectAgent(t, agentPath, "agent", "hcp-1")
	conn, r := f.connect(t, apiServerPath, connectTo("10.96.0.10:443"))
	order := agent.Order(t, &tunnelv1.Target{Cluster: "hcp-1", Ip: "10.96.0.10", Port: 443})
	tun, _ := agent.Open(t, order.GetDialId())
	if code, body := answer(t, r); code != http.StatusOK {
		t.Fatalf("answer %d %s, want 200", code, body)
	}
	roundTrip(t, conn, r, tun)

	// An identity without an egress rule is refused, and no dial is made.
	denied := metrics.Denied.WithLabelValues(authz.AskedEgress)
	before := promtestutil.ToFloat64(denied)
	_, r = f.connect(t, strangerPath, connectTo("10.96.0.10:443"))
	if code, body := answer(t, r); code != http.StatusForbidden || !strings.Contains(body, "no egress rule") {
		t.Fatalf("a stranger got %d %q, want 403", code, body)
	}
	if got := promtestutil.ToFloat64(denied) - before; got != 1 {
		t.Errorf("denied_total{asked=egress} rose by %v, want 1", got)
	}
}

func TestConnectRefusesBadRequests(t *testing.T) {
	f := startUDS(t, "hcp-1")
	for _, c := range []struct {
		request string
		code    int
	}{
		{"GET / HTTP/1.1\r\nHost: x\r\n\r\n", http.StatusMethodNotAllowed},
		{connectTo("example.com:443"), http.StatusBadRequest},
		{connectTo("webhook.default:443"), http.StatusBadRequest},
		{connectTo("10.96.0.10"), http.StatusBadRequest},
		{connectTo("10.96.0.10:0443"), http.StatusBadRequest},
		{connectTo("10.96.0.10:65536"), http.StatusBadRequest},
		{connectTo("[fe80::1%25eth0]:443"), http.StatusBadRequest},
		{connectTo("Webhook.default.svc:443"), http.StatusBadRequest},
		{"CONNECT 10.96.0.10:443 HTTP/1.1\r\nX: " + strings.Repeat("x", 8<<10) + "\r\n\r\n", http.StatusBadRequest},
		{"not http\r\n\r\n", http.StatusBadRequest},
	} {
		_, r := f.connect(t, "", c.request)
		if code, body := answer(t, r); code != c.code {
			t.Errorf("%.60q: answer %d %s, want %d", c.request, code, body, c.code)
		} else {
			t.Logf("%.60q: %d %s", c.request, code, body)
		}
	}
}

// The agent's failures reach the client as HTTP statuses with the reason.
func TestConnectMapsDialFailuresToHTTP(t *testing.T) {
	f := startUDS(t, "hcp-1")
	agent := f.ConnectAgent(t, agentPath, "agent", "hcp-1")
	for _, c := range []struct {
		code codes.Code
		want int
	}{
		{codes.PermissionDenied, http.StatusForbidden},
		{codes.NotFound, http.StatusNotFound},
		{codes.Unavailable, http.StatusServiceUnavailable},
		{codes.DeadlineExceeded, http.StatusGatewayTimeout},
		{codes.ResourceExhausted, http.StatusTooManyRequests},
		{codes.InvalidArgument, http.StatusBadRequest},
	} {
		_, r := f.connect(t, "", connectTo("10.96.0.99:443"))
		order := agent.Order(t, &tunnelv1.Target{Cluster: "hcp-1", Ip: "10.96.0.99", Port: 443})
		failure := &tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_DialFailure{DialFailure: &tunnelv1.DialFailure{
			DialId: order.GetDialId(), Code: int32(c.code), Message: "refused: no Service has that address"}}}
		if err := agent.Control.Send(failure); err != nil {
			t.Fatal(err)
		}
		if code, body := answer(t, r); code != c.want || !strings.Contains(body, "no Service has that address") {
			t.Errorf("%v: answer %d %q, want %d with the agent's reason", c.code, code, body, c.want)
		}
	}
	// No agent serves the cluster of another socket.
	other := startUDS(t, "hcp-2")
	_, r := other.connect(t, "", connectTo("10.96.0.10:443"))
	if code, body := answer(t, r); code != http.StatusServiceUnavailable {
		t.Errorf("a cluster nobody serves: answer %d %q, want 503", code, body)
	}
}

// A client that never finishes its request is dropped at the front end's
// timeout, and one over the bound on unanswered connections at once.
func TestConnectBoundsUnansweredConnections(t *testing.T) {
	b := startBroker(t)
	path := filepath.Join(t.TempDir(), "egress.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	serve(t, b, Config{Name: "uds", Cluster: "hcp-1", Timeout: 200 * time.Millisecond, MaxOpening: 1}, l)
	f := &frontEnd{Server: b, addr: path, network: "unix"}
	silent, r := f.connect(t, "", "CONNECT 10.96.0.10:443 HTTP/1.1\r\n") // and nothing more
	if _, err := r.ReadByte(); err == nil {
		t.Fatal("a request that never ends got an answer")
	}
	silent.Close()
	// The slot is free again once the front end dropped it.
	testutil.Eventually(t, "a new connection to be served", func() bool {
		_, r := f.connect(t, "", "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
		resp, err := http.ReadResponse(r, nil)
		return err == nil && resp.StatusCode == http.StatusMethodNotAllowed
	})
}

// closedSoon reports whether the front end has closed c, waiting a little.
func closedSoon(c net.Conn) bool {
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Millisecond))
	_, err := c.Read(make([]byte, 1))
	ne, ok := err.(net.Error)
	return err != nil && !(ok && ne.Timeout())
}

// A TLS front end's connections that never start their handshake wait in
// a handshake slot, which one stalled over a second gives up to a new
// connection, and not in an opening place: only a verified peer waits for
// its answer in one. So they cannot keep a verified caller out.
func TestConnectOverMTLSIsAnsweredWhileConnectionsStallTheirHandshakes(t *testing.T) {
	f := serveTLSWith(t, startBroker(t), Config{MaxOpening: 1}, identity.MaxConcurrentHandshakes(2))

	// Two take the handshake slots, the others are closed at once.
	stalled := make([]net.Conn, 4)
	for i := range stalled {
		var err error
		if stalled[i], err = net.Dial("tcp", f.addr); err != nil {
			t.Fatal(err)
		}
		defer stalled[i].Close()
	}
	time.Sleep(1500 * time.Millisecond) // the slots' holders have stalled for over a second
	for i := range 2 {
		_, r := f.connect(t, apiServerPath, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
		if code, body := answer(t, r); code != http.StatusMethodNotAllowed {
			t.Fatalf("request %d of a verified peer while connections stall: %d %s, want 405", i+1, code, body)
		}
	}
	// The first one took the place of a stalled handshake.
	closed := make([]bool, len(stalled))
	testutil.Eventually(t, "3 of the stalled connections to be closed", func() bool {
		n := 0
		for i, c := range stalled {
			closed[i] = closed[i] || closedSoon(c)
			if closed[i] {
				n++
			}
		}
		return n >= 3
	})
}

// A Unix socket's peers are vouched for by its file mode: each waits in
// an opening place from its accept, and past the bound a new connection
// is closed unanswered.
func TestConnectOverUDSSilentConnectionsHoldTheirOpeningPlace(t *testing.T) {
	b := startBroker(t)
	path := filepath.Join(t.TempDir(), "egress.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	serve(t, b, Config{Name: "uds", Cluster: "hcp-1", MaxOpening: 1}, l)
	f := &frontEnd{Server: b, addr: path, network: "unix"}
	silent, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	over, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer over.Close()
	_ = over.SetReadDeadline(time.Now().Add(testutil.WaitLong))
	if n, err := over.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("a connection past the bound read %d bytes, %v; want it closed", n, err)
	}
	silent.Close()
	testutil.Eventually(t, "a new connection to be served once the silent one went", func() bool {
		_, r := f.connect(t, "", "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
		resp, err := http.ReadResponse(r, nil)
		return err == nil && resp.StatusCode == http.StatusMethodNotAllowed
	})
}
