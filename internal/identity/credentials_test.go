package identity

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"google.golang.org/grpc/credentials"

	"github.com/kcp-dev/tunnel-broker/internal/devca"
)

// malformedIDs are leaf certificates from a trusted CA whose URI SANs no
// workload may hold, each with the reason it is refused for.
func malformedIDs() map[string][]string {
	return map[string][]string{
		"no path (the trust domain's own ID)": {"spiffe://" + testTD},
		"an ID longer than 2048 bytes":        {"spiffe://" + testTD + "/" + strings.Repeat("a", 3000)},
		"two URI SANs":                        {"spiffe://" + testTD + "/a", "spiffe://" + testTD + "/b"},
		"not a SPIFFE ID":                     {"https://" + testTD + "/a"},
		"a trailing slash":                    {"spiffe://" + testTD + "/a/"},
		"no URI SAN at all":                   nil,
	}
}

func TestAServerRefusesPeersWithMalformedIDsAndServesTheNext(t *testing.T) {
	ca := newCA(t, "ca")
	broker := newSource(t, ca, devca.Leaf{SPIFFEID: "/broker"})
	var log logBuffer
	var refusals counts
	creds := ServerCredentials(broker, tlsconfig.AuthorizeAny(), ReportRefusals(&Refusals{Log: log.logger(), Count: refusals.count, PerSecond: 100}))
	addr, results := serve(t, creds)
	good := attackerConfig(rawCert(t, ca, devca.Leaf{SPIFFEID: "/kcp"}))

	n := 0
	for name, sans := range malformedIDs() {
		t.Run(name, func(t *testing.T) {
			_, err := dialAndRead(addr, attackerConfig(rawCert(t, ca, devca.Leaf{URIs: uris(t, sans...)})))
			if err == nil {
				t.Fatal("the client was admitted")
			}
			r := next(t, results)
			if ReasonOf(r.err) != ReasonInvalidID {
				t.Fatalf("refused for %q (%v), want %q", ReasonOf(r.err), r.err, ReasonInvalidID)
			}
			n++
			// The server goes on: a well-formed SVID is admitted next.
			if _, err := dialAndRead(addr, good); err != nil {
				t.Fatalf("a good client after it: %v", err)
			}
			if r := next(t, results); r.err != nil || r.info.ID.String() != "spiffe://"+testTD+"/kcp" {
				t.Fatalf("a good client after it: %+v", r)
			}
		})
	}
	if got := refusals.get(ReasonInvalidID); got != n {
		t.Errorf("counted %d refusals, want %d", got, n)
	}
	if lines := log.lines(); len(lines) != n || !strings.Contains(strings.Join(lines, "\n"), "has no path: it names a trust domain, not a workload") {
		t.Errorf("want %d lines, one saying the ID has no path; got:\n%s", n, strings.Join(lines, "\n"))
	}
}

func TestAClientRefusesServersWithMalformedIDs(t *testing.T) {
	ca := newCA(t, "ca")
	agent := newSource(t, ca, devca.Leaf{SPIFFEID: "/agent"})
	var log logBuffer
	var refusals counts
	// As the agent does by default: any server of its trust domain.
	creds := ClientCredentials(agent, tlsconfig.AuthorizeMemberOf(spiffeid.RequireTrustDomainFromString(testTD)),
		ReportRefusals(&Refusals{Log: log.logger(), Count: refusals.count, PerSecond: 100}))
	for name, sans := range malformedIDs() {
		t.Run(name, func(t *testing.T) {
			addr := maliciousServer(t, rawCert(t, ca, devca.Leaf{URIs: uris(t, sans...)}))
			_, _, err := clientHandshake(t, creds, addr)
			if err == nil {
				t.Fatal("the server was accepted")
			}
			if r := ReasonOf(err); r != ReasonInvalidID {
				t.Fatalf("refused for %q (%v), want %q", r, err, ReasonInvalidID)
			}
		})
	}
	addr := maliciousServer(t, rawCert(t, ca, devca.Leaf{URIs: uris(t, "spiffe://"+testTD)}))
	_, _, err := clientHandshake(t, creds, addr)
	if err == nil || !strings.Contains(err.Error(), "has no path") {
		t.Fatalf("a server without a path: %v", err)
	}
	if !strings.Contains(strings.Join(log.lines(), "\n"), "has no path") {
		t.Errorf("the client's log does not say why:\n%s", strings.Join(log.lines(), "\n"))
	}
	// And a well-formed server is accepted, with its verified ID.
	addr = maliciousServer(t, rawCert(t, ca, devca.Leaf{SPIFFEID: "/broker"}))
	conn, info, err := clientHandshake(t, creds, addr)
	if err != nil {
		t.Fatal(err)
	}
	conn.Close()
	if got := info.(AuthInfo).ID.String(); got != "spiffe://"+testTD+"/broker" {
		t.Fatalf("peer ID %s", got)
	}
}

// maliciousServer is a TLS server presenting cert to every client, with
// gRPC's ALPN, until the test ends. Like a gRPC server, it speaks first
// once the handshake is done (its SETTINGS): the client's handshake waits
// for that.
func maliciousServer(t *testing.T, cert tls.Certificate) string {
	t.Helper()
	lis, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2"}, ClientAuth: tls.RequireAnyClientCert})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			conn, err := lis.Accept()
			if err != nil {
				return
			}
			if conn.(*tls.Conn).Handshake() == nil {
				conn.Write([]byte{0})
			}
			conn.Close()
		}
	}()
	t.Cleanup(func() { lis.Close(); <-done })
	return lis.Addr().String()
}

func clientHandshake(t *testing.T, creds credentials.TransportCredentials, addr string) (net.Conn, credentials.AuthInfo, error) {
	t.Helper()
	raw, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitLong)
	defer cancel()
	conn, info, err := creds.ClientHandshake(ctx, addr, raw)
	if err != nil {
		raw.Close()
	}
	return conn, info, err
}

func TestAResumedSessionIsVerifiedAgainstTheCurrentBundle(t *testing.T) {
	oldCA, newCA := newCA(t, "old"), newCA(t, "new")
	broker := newSource(t, oldCA, devca.Leaf{SPIFFEID: "/broker"})
	broker.trustOnly(oldCA, newCA)
	addr, results := serve(t, ServerCredentials(broker, tlsconfig.AuthorizeAny()))

	// A client that keeps session tickets, as an attacker's would.
	client := newSource(t, oldCA, devca.Leaf{SPIFFEID: "/kcp"})
	cfg := tlsconfig.MTLSClientConfig(client, broker, tlsconfig.AuthorizeAny())
	cfg.NextProtos = []string{"h2"}
	cfg.ClientSessionCache = tls.NewLRUClientSessionCache(4)

	if _, err := dialAndRead(addr, cfg); err != nil {
		t.Fatal(err)
	}
	next(t, results)
	// The broker offers resumption: the second connection resumes.
	cs, err := dialAndRead(addr, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if r := next(t, results); r.err != nil || !cs.DidResume || !r.info.State.DidResume {
		t.Fatalf("the session was not resumed (client %v, server %+v): the test proves nothing", cs.DidResume, r)
	}

	// The old CA leaves the bundle: the client's ticket no longer admits it.
	broker.trustOnly(newCA)
	_, err = dialAndRead(addr, cfg)
	if err == nil {
		t.Fatal("a client with a session ticket was admitted after its CA left the bundle")
	}
	r := next(t, results)
	if ReasonOf(r.err) != ReasonUntrusted {
		t.Fatalf("refused for %q (%v), want %q", ReasonOf(r.err), r.err, ReasonUntrusted)
	}
}

func TestRefusalsNameTheirReason(t *testing.T) {
	ca, stranger := newCA(t, "ca"), newCA(t, "stranger")
	broker := newSource(t, ca, devca.Leaf{SPIFFEID: "/broker"})
	addr, results := serve(t, ServerCredentials(broker, tlsconfig.AuthorizeID(spiffeid.RequireFromString("spiffe://"+testTD+"/kcp"))))
	for _, tc := range []struct {
		name   string
		client func() error
		want   Reason
	}{
		{"no client certificate", func() error {
			_, err := dialAndRead(addr, &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"h2"}})
			return err
		}, ReasonNoCertificate},
		{"an unknown CA", func() error {
			_, err := dialAndRead(addr, attackerConfig(rawCert(t, stranger, devca.Leaf{SPIFFEID: "/kcp"})))
			return err
		}, ReasonUntrusted},
		{"an expired SVID", func() error {
			_, err := dialAndRead(addr, attackerConfig(rawCert(t, ca, devca.Leaf{SPIFFEID: "/kcp", NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(-time.Minute)})))
			return err
		}, ReasonExpired},
		{"another workload", func() error {
			_, err := dialAndRead(addr, attackerConfig(rawCert(t, ca, devca.Leaf{SPIFFEID: "/other"})))
			return err
		}, ReasonUnauthorized},
		{"not TLS", func() error {
			c, err := net.Dial("tcp", addr)
			if err != nil {
				return err
			}
			defer c.Close()
			c.Write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
			_, err = c.Read(make([]byte, 1))
			return err
		}, ReasonProtocol},
		{"closed at once", func() error {
			c, err := net.Dial("tcp", addr)
			if err != nil {
				return err
			}
			c.Close()
			return errors.New("closed")
		}, ReasonClosed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.client() == nil {
				t.Fatal("admitted")
			}
			r := next(t, results)
			if got := ReasonOf(r.err); got != tc.want {
				t.Fatalf("reason %q (%v), want %q", got, r.err, tc.want)
			}
		})
	}
}

func TestValidateWorkloadID(t *testing.T) {
	for _, tc := range []struct {
		id   string
		want string // part of the error; "" for none
	}{
		{"spiffe://example.org/ns/kcp/sa/kcp", ""},
		{"spiffe://example.org", "has no path"},
		{"spiffe://example.org/" + strings.Repeat("a", MaxIDLength-len("spiffe://example.org/")), ""},
		{"spiffe://example.org/" + strings.Repeat("a", MaxIDLength), "more than the 2048 bytes"},
		{"spiffe://" + strings.Repeat("a", MaxTrustDomainLength) + "/x", ""},
		{"spiffe://" + strings.Repeat("a", MaxTrustDomainLength+1) + "/x", "trust domain name of 256 bytes"},
	} {
		err := ValidateWorkloadID(spiffeid.RequireFromString(tc.id))
		if (err == nil) != (tc.want == "") || err != nil && !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%.40s...: %v, want %q", tc.id, err, tc.want)
		}
		if err != nil && len(err.Error()) > 400 {
			t.Errorf("%.40s...: an error of %d bytes", tc.id, len(err.Error()))
		}
	}
	if err := ValidateWorkloadID(spiffeid.ID{}); err == nil {
		t.Error("the zero ID passed")
	}
}

// A client pointed at a port of the broker that does not serve gRPC (its
// metrics port, plain HTTP; its CONNECT port, TLS without HTTP/2) says so
// rather than "first record does not look like a TLS handshake" or
// "missing selected ALPN property".
func TestAClientPointedAtAPortThatIsNotGRPCSaysSo(t *testing.T) {
	ca := newCA(t, "ca")
	agent := newSource(t, ca, devca.Leaf{SPIFFEID: "/agent"})
	creds := ClientCredentials(agent, tlsconfig.AuthorizeMemberOf(spiffeid.RequireTrustDomainFromString(testTD)))

	plain := httptest.NewServer(http.NotFoundHandler())
	t.Cleanup(plain.Close)
	lis, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{rawCert(t, ca, devca.Leaf{SPIFFEID: "/broker"})}})
	if err != nil {
		t.Fatal(err)
	}
	withoutH2 := &http.Server{Handler: http.NotFoundHandler(), TLSNextProto: map[string]func(*http.Server, *tls.Conn, http.Handler){}}
	go func() { _ = withoutH2.Serve(lis) }()
	t.Cleanup(func() { withoutH2.Close() })

	for name, tc := range map[string]struct{ addr, why string }{
		"plain HTTP":     {strings.TrimPrefix(plain.URL, "http://"), "it does not speak TLS"},
		"TLS without h2": {lis.Addr().String(), "it speaks TLS, but not HTTP/2"},
	} {
		t.Run(name, func(t *testing.T) {
			_, _, err := clientHandshake(t, creds, tc.addr)
			if !errors.Is(err, ErrNotGRPC) || !strings.Contains(err.Error(), tc.why) ||
				!strings.Contains(err.Error(), "is that the broker's --listen port, not its metrics or CONNECT port?") {
				t.Fatalf("handshake: %v, want ErrNotGRPC saying %q and which port to use", err, tc.why)
			}
		})
	}
}
