package e2e

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kcp-dev/tunnel-broker/internal/devca"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	"github.com/kcp-dev/tunnel-broker/kcpplugin"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// These tests attack the broker and the syncer-agent binaries at the TLS
// layer: peers with SPIFFE IDs no workload may hold, expired SVIDs, session
// tickets that outlive their CA, and connections that never finish their
// handshake.

// malformedLeaf is a certificate from the trust domain's own CA, whose URI
// SAN is raw, as an attacker with a signing key of the trust domain (or a
// misconfigured registration) would hold.
func malformedLeaf(t *testing.T, env *harness.Env, raw string) tls.Certificate {
	t.Helper()
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	issued, err := env.CA.Issue(devca.Leaf{URIs: []*url.URL{u}})
	if err != nil {
		t.Fatal(err)
	}
	cert, err := tls.X509KeyPair(issued.CertPEM, issued.KeyPEM)
	if err != nil {
		t.Fatal(err)
	}
	return cert
}

// healthCheck asks the broker's health service, as the caller /kcp.
func healthCheck(t *testing.T, conn *grpc.ClientConn) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
	return err
}

// alive fails the test if the process has exited.
func alive(t *testing.T, p *harness.Process, what string) {
	t.Helper()
	select {
	case <-p.Done():
		t.Fatalf("the %s exited: %v", what, p.Cmd.ProcessState)
	default:
	}
}

func TestHardeningBrokerRefusesMalformedSPIFFEIDsAndKeepsServing(t *testing.T) {
	env := harness.NewEnv(t)
	broker, addr := env.StartBrokerProcess()
	kcp := env.BrokerConn(addr, "/kcp")
	for _, tc := range []struct{ name, id, says string }{
		{"no path", "spiffe://" + harness.TrustDomain, "has no path: it names a trust domain, not a workload"},
		{"3000 bytes", "spiffe://" + harness.TrustDomain + "/" + strings.Repeat("a", 3000), "more than the 2048 bytes SPIFFE allows"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cert := malformedLeaf(t, env, tc.id)
			conn, err := tls.Dial("tcp", addr, &tls.Config{Certificates: []tls.Certificate{cert}, InsecureSkipVerify: true, NextProtos: []string{"h2"}})
			if err == nil {
				// TLS 1.3: the broker's verdict on the client's
				// certificate comes after the client's side is done.
				conn.SetDeadline(time.Now().Add(20 * time.Second))
				_, err = conn.Read(make([]byte, 1))
				conn.Close()
			}
			if err == nil || !strings.Contains(err.Error(), "bad certificate") {
				t.Fatalf("the handshake ended with %v, want the broker's bad certificate alert", err)
			}
			broker.WaitLogged(t, 1, "TLS handshake refused", "reason=invalid_id", tc.says)
			alive(t, broker, "broker")
			if err := healthCheck(t, kcp); err != nil {
				t.Fatalf("a good caller after it: %v", err)
			}
		})
	}
	harness.Eventually(t, 10*time.Second, "both refusals to be counted", func() bool {
		n, _ := scrape(t, broker, `kcp_tunnel_broker_handshakes_refused_total{reason="invalid_id"}`)
		return n == 2
	})
}

// maliciousBroker is a TLS server presenting cert, with gRPC's ALPN, that
// counts the handshakes it completes.
func maliciousBroker(t *testing.T, cert tls.Certificate) (string, *atomic.Int64) {
	t.Helper()
	lis, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2"}, ClientAuth: tls.RequireAnyClientCert})
	if err != nil {
		t.Fatal(err)
	}
	var attempts atomic.Int64
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			conn, err := lis.Accept()
			if err != nil {
				return
			}
			attempts.Add(1)
			conn.(*tls.Conn).Handshake()
			conn.Close()
		}
	}()
	t.Cleanup(func() { lis.Close(); <-done })
	return lis.Addr().String(), &attempts
}

func TestHardeningAgentRefusesABrokerWithAMalformedSPIFFEID(t *testing.T) {
	env := harness.NewEnv(t)
	_, good := env.StartBrokerProcess()
	bad, attempts := maliciousBroker(t, malformedLeaf(t, env, "spiffe://"+harness.TrustDomain))
	echo := harness.StartEcho(t)
	// Without --broker-spiffe-id (its default), the agent accepts any
	// broker of its trust domain: the malformed one must not take it down.
	agent := env.RunAgentProcess(good+","+bad, "sync-target-1", env.SVID("/agent/sync-target-1"), lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: "root", Namespace: "default", Name: "echo", Ports: map[string]string{"80": echo}},
	}})
	harness.Eventually(t, 20*time.Second, "the agent to try the malformed broker again", func() bool { return attempts.Load() >= 2 })
	alive(t, agent, "agent")
	agent.WaitLogged(t, 1, "TLS handshake refused", "reason=invalid_id", "has no path: it names a trust domain, not a workload", bad)
	// It serves the good broker all along.
	if err := dialEcho(brokerDialer(env, good)); err != nil {
		t.Fatalf("dial through the good broker: %v", err)
	}
	alive(t, agent, "agent")
	if n, _ := scrape(t, agent, `kcp_tunnel_agent_handshakes_refused_total{reason="invalid_id"}`); n < 1 {
		t.Errorf("the agent counted %v refused handshakes, want at least 1", n)
	}
}

func TestHardeningAnExpiredCallerCannotDialOnItsOpenConnection(t *testing.T) {
	env := harness.NewEnv(t)
	broker, addr := env.StartBrokerProcess("--expired-peer-grace", "60s")
	env.StartAgentProcess(addr, "/agent/sync-target-1", echoServices(harness.StartEcho(t)))
	f, expires := shortSVID(t, env, "/kcp", 4*time.Second)
	kcp := kcpDialerWith(t, addr, f)
	// A tunnel in flight keeps the caller's connection open past the expiry.
	tunnel, err := dialEchoConn(kcp)
	if err != nil {
		t.Fatalf("before the expiry: %v", err)
	}
	defer tunnel.Close()
	roundTrip(t, tunnel, "before the expiry")

	time.Sleep(time.Until(expires))
	harness.Eventually(t, 20*time.Second, "dials to be refused after the caller's SVID expired", func() bool {
		return dialEcho(kcp) != nil
	})
	_, err = dialEchoConn(kcp)
	testutil.CheckStatus(t, "a dial on the open connection", err, codes.Unauthenticated,
		"the X.509-SVID of spiffe://tunnel.test/kcp expired at "+expires.UTC().Format(time.RFC3339))
	// The tunnel in flight runs on, within the grace period.
	roundTrip(t, tunnel, "after the expiry")

	// Its last tunnel over, the connection closes, and the expired SVID
	// cannot open another.
	tunnel.Close()
	harness.Eventually(t, 20*time.Second, "the broker to refuse the expired SVID's handshake", func() bool {
		_ = dialEcho(kcp)
		n, _ := scrape(t, broker, `kcp_tunnel_broker_handshakes_refused_total{reason="expired"}`)
		return n >= 1
	})
	broker.WaitLogged(t, 1, "TLS handshake refused", "reason=expired")
}

// TestHardeningARotatedCallerKeepsDialingPastItsOldSVIDsExpiry: the broker
// asks every client to move to a new connection every --max-connection-age,
// so a caller whose SVID rotated (SPIRE rotates at half an SVID's life)
// dials over a connection with its new SVID before the old one expires, and
// no dial is refused for an expired SVID.
func TestHardeningARotatedCallerKeepsDialingPastItsOldSVIDsExpiry(t *testing.T) {
	env := harness.NewEnv(t)
	_, addr := env.StartBrokerProcess("--max-connection-age", "1s")
	env.StartAgentProcess(addr, "/agent/sync-target-1", echoServices(harness.StartEcho(t)))
	const lifetime = 10 * time.Second
	f, expires := shortSVID(t, env, "/kcp", lifetime)
	kcp := kcpDialerWith(t, addr, f)
	harness.Eventually(t, 20*time.Second, "a first dial", func() bool { return dialEcho(kcp) == nil })
	// A tunnel in flight, as kcp's webhook client keeps idle connections,
	// keeps the first connection open past the expiry.
	held, err := dialEchoConn(kcp)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()

	time.Sleep(time.Until(expires.Add(-lifetime / 2)))
	if _, err := env.CA.WriteSVID(filepath.Dir(f.Cert), devca.Leaf{SPIFFEID: "/kcp", NotAfter: time.Now().Add(time.Hour)}); err != nil {
		t.Fatal(err)
	}
	dials := 0
	for time.Now().Before(expires.Add(3 * time.Second)) {
		if err := dialEcho(kcp); err != nil {
			t.Fatalf("dial %d, %v after the first SVID expired: %v", dials, time.Since(expires).Round(time.Millisecond), err)
		}
		dials++
		time.Sleep(20 * time.Millisecond)
	}
	roundTrip(t, held, "the tunnel held across the expiry")
	t.Logf("%d dials across the expiry, none refused", dials)
}

// kcpDialerWith is a caller with the SVID files f.
func kcpDialerWith(t *testing.T, addr string, f devca.Files) *kcpplugin.Dialer {
	t.Helper()
	src := loadWatched(t, f)
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(identity.ClientCredentials(src, tlsconfig.AuthorizeID(harness.ID("/broker")))))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return waitingDialer(conn)
}

func TestHardeningAnExpiredAgentIsUnrouted(t *testing.T) {
	env := harness.NewEnv(t)
	broker, addr := env.StartBrokerProcess("--expired-peer-grace", "2s")
	f, expires := shortSVID(t, env, "/agent/sync-target-1", 5*time.Second)
	agent := env.RunAgentProcess(addr, "sync-target-1", f, echoServices(harness.StartEcho(t)))
	kcp := brokerDialer(env, addr)
	harness.Eventually(t, 20*time.Second, "the agent to register", func() bool { return dialEcho(kcp) == nil })

	time.Sleep(time.Until(expires))
	harness.Eventually(t, 20*time.Second, "the agent to be unrouted once its SVID expired", func() bool {
		err := dialEcho(kcp)
		return err != nil && strings.Contains(err.Error(), `no agent serves logical cluster "root"`)
	})
	broker.WaitLogged(t, 1, "agent SVID expired, registration ended", "spiffe://tunnel.test/agent/sync-target-1")
	// It cannot come back with the expired SVID, and stays unrouted.
	broker.WaitLogged(t, 1, "TLS handshake refused", "reason=expired")
	if err := dialEcho(kcp); err == nil {
		t.Fatal("a dial reached the agent whose SVID expired")
	}
	alive(t, agent, "agent")
}

func TestHardeningASessionTicketDoesNotOutliveItsCA(t *testing.T) {
	env := harness.NewEnv(t)
	_, addr := env.StartBrokerProcess("--svid-reload-interval", "50ms")
	// A caller that keeps session tickets, as an attacker may.
	src := env.Identity("/kcp")
	var resumed atomic.Int64
	cfg := tlsconfig.MTLSClientConfig(src, src, tlsconfig.AuthorizeID(harness.ID("/broker")))
	cfg.ClientSessionCache = tls.NewLRUClientSessionCache(8)
	cfg.VerifyConnection = func(cs tls.ConnectionState) error {
		if cs.DidResume {
			resumed.Add(1)
		}
		return nil
	}
	ticketHolder := func() *grpc.ClientConn {
		conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return conn
	}
	first := ticketHolder()
	if err := healthCheck(t, first); err != nil {
		t.Fatal(err)
	}
	first.Close()
	// The broker resumes sessions: a second connection does.
	if err := healthCheck(t, ticketHolder()); err != nil || resumed.Load() != 1 {
		t.Fatalf("second connection: %v, resumed %d times; want it resumed", err, resumed.Load())
	}

	// The CA is rotated out: the broker's bundle holds only a new one.
	next, err := devca.New("next", harness.TrustDomain)
	if err != nil {
		t.Fatal(err)
	}
	writeAtomically(t, filepath.Join(env.Dir, "svid", "broker", "ca.crt"), next.BundlePEM())
	kcp := env.Identity("/kcp")
	harness.Eventually(t, 20*time.Second, "the broker to refuse new connections of the old CA's SVIDs", func() bool {
		conn := env.ConnWith(addr, kcp)
		defer conn.Close()
		return healthCheck(t, conn) != nil
	})

	// The ticket of the old CA's SVID no longer admits anyone.
	before := resumed.Load()
	err = healthCheck(t, ticketHolder())
	if resumed.Load() == before {
		t.Fatalf("the client did not resume its session (%v): the test proves nothing", err)
	}
	if err == nil {
		t.Fatal("a session ticket from before admitted its holder after its CA left the bundle")
	}
}

// stall opens a connection to addr that never says a word.
func stall(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// closedByPeer reports whether the peer closed c within the wait.
func closedByPeer(c net.Conn, wait time.Duration) bool {
	c.SetReadDeadline(time.Now().Add(wait))
	_, err := c.Read(make([]byte, 1))
	ne, timedOut := err.(net.Error)
	return err != nil && !(timedOut && ne.Timeout())
}

func TestHardeningStalledHandshakesEndAtTheDeadlineAndAreLoggedSparingly(t *testing.T) {
	env := harness.NewEnv(t)
	broker, addr := env.StartBrokerProcess("--handshake-timeout", "1s")
	const n = 40
	conns := make([]net.Conn, n)
	for i := range conns {
		conns[i] = stall(t, addr)
	}
	for i, c := range conns {
		if !closedByPeer(c, 30*time.Second) {
			t.Fatalf("stalled connection %d still open after 30s", i)
		}
	}
	harness.Eventually(t, 10*time.Second, "every stalled handshake to be counted", func() bool {
		got, _ := scrape(t, broker, `kcp_tunnel_broker_handshakes_refused_total{reason="timeout"}`)
		return got == n
	})
	// A few lines a second, and one that says how many more there were.
	var logged, suppressed int
	harness.Eventually(t, 10*time.Second, "the log to account for every refusal", func() bool {
		logged = len(broker.Logged("TLS handshake refused", "reason=timeout"))
		suppressed = 0
		for _, line := range broker.Logged("more TLS handshakes refused") {
			var k int
			if _, err := fmt.Sscanf(line[strings.Index(line, "suppressed=")+len("suppressed="):], "%d", &k); err == nil {
				suppressed += k
			}
		}
		return logged+suppressed == n
	})
	if logged >= n/2 {
		t.Errorf("%d of %d refusals logged one by one", logged, n)
	}
	if err := healthCheck(t, env.BrokerConn(addr, "/kcp")); err != nil {
		t.Fatalf("a good caller after them: %v", err)
	}
}

func TestHardeningStalledHandshakesCannotLockOutCallers(t *testing.T) {
	env := harness.NewEnv(t)
	broker, addr := env.StartBrokerProcess("--handshake-timeout", "60s", "--max-concurrent-handshakes", "4")
	var stalled []net.Conn
	for range 4 {
		stalled = append(stalled, stall(t, addr))
	}
	// Every slot is held by a handshake that has stalled for over a second.
	time.Sleep(1500 * time.Millisecond)
	if err := healthCheck(t, env.BrokerConn(addr, "/kcp")); err != nil {
		t.Fatalf("a caller while every handshake slot was held: %v", err)
	}
	// The oldest gave way to it, and was counted.
	harness.Eventually(t, 20*time.Second, "a stalled handshake to give way", func() bool {
		for _, c := range stalled {
			if closedByPeer(c, 10*time.Millisecond) {
				return true
			}
		}
		return false
	})
	harness.Eventually(t, 10*time.Second, "the dropped handshake to be counted", func() bool {
		got, _ := scrape(t, broker, `kcp_tunnel_broker_handshakes_refused_total{reason="over_limit"}`)
		return got >= 1
	})
}

// stallForever keeps n connections to addr that never say a word, each
// opened again as soon as the server closes it, until ctx ends; it returns
// how many connections were made in all, and waits for its goroutines.
func stallForever(ctx context.Context, addr string, n int) (dialed *atomic.Int64, wait func()) {
	dialed = new(atomic.Int64)
	done := make(chan struct{}, n)
	for range n {
		go func() {
			defer func() { done <- struct{}{} }()
			for ctx.Err() == nil {
				c, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
				if err != nil {
					time.Sleep(10 * time.Millisecond)
					continue
				}
				dialed.Add(1)
				stop := context.AfterFunc(ctx, func() { c.Close() })
				_, _ = c.Read(make([]byte, 1)) // until the server closes it
				stop()
				c.Close()
			}
		}()
	}
	return dialed, func() {
		for range n {
			<-done
		}
	}
}

// 200 connections to --egress-listen that never start their TLS handshake,
// each reconnecting as soon as the broker closes it, must not keep
// kube-apiserver's CONNECTs out: stalled handshakes are bounded as on the
// gRPC port, and a connection waits for its answer in one of the front
// end's 128 opening places only once its peer is verified.
func TestEgressListenerAnswersCONNECTUnderStalledHandshakes(t *testing.T) {
	env := harness.NewEnv(t)
	broker, _, egress := startFrontEnds(t, env)

	const stallers = 200
	ctx, cancel := context.WithCancel(context.Background())
	dialed, wait := stallForever(ctx, egress, stallers)
	defer wait()
	defer cancel()
	harness.Eventually(t, 20*time.Second, "every stalled connection to be open", func() bool {
		return dialed.Load() >= stallers
	})
	// Every one has stalled for over a second.
	time.Sleep(1500 * time.Millisecond)

	// kube-apiserver's egress dialer: a CONNECT over mTLS with its SVID,
	// several over a few seconds, each answered and carrying bytes.
	const attempts = 5
	answered := 0
	for i := range attempts {
		if i > 0 {
			time.Sleep(1200 * time.Millisecond)
		}
		start := time.Now()
		code, conn, body, err := tryConnect(env, egress, "/kcp", "echo.default.svc:80")
		switch {
		case err != nil:
			t.Logf("CONNECT %d: %v (after %v)", i+1, err, time.Since(start).Round(time.Millisecond))
		case code != http.StatusOK:
			t.Logf("CONNECT %d: %d %s", i+1, code, body)
		default:
			roundTrip(t, conn, fmt.Sprintf("CONNECT %d under stalled handshakes", i+1))
			conn.Close()
			answered++
			t.Logf("CONNECT %d: 200 and bytes both ways in %v", i+1, time.Since(start).Round(time.Millisecond))
		}
	}
	t.Logf("%d connections made by %d stalling peers", dialed.Load(), stallers)
	if answered != attempts {
		t.Fatalf("%d of %d CONNECTs answered while %d connections stalled their handshakes", answered, attempts, stallers)
	}
	// The stalled handshakes ended at the deadline, counted as the gRPC
	// port's are.
	if n, _ := scrape(t, broker, `kcp_tunnel_broker_handshakes_refused_total{reason="timeout"}`); n < stallers {
		t.Errorf("%v stalled handshakes counted as timed out, want at least %d", n, stallers)
	}
}
