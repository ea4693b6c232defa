package identity

import (
	"crypto/tls"
	"crypto/x509"
	"log/slog"
	"net"
	"net/url"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"go.uber.org/goleak"
	"google.golang.org/grpc/credentials"

	"github.com/kcp-dev/tunnel-broker/internal/devca"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
)

// This file holds what the tests of the credentials share: a dev trust
// domain, SVIDs (well-formed or not), real TLS handshakes on loopback
// through the credentials under test, and a log to read.

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const testTD = "example.org"

// waitLong bounds every wait for something that should happen; far above
// what a healthy run needs.
const waitLong = 20 * time.Second

func newCA(t testing.TB, name string) *devca.CA {
	t.Helper()
	ca, err := devca.New(name, testTD)
	if err != nil {
		t.Fatal(err)
	}
	return ca
}

// svidSource is an SVID and a bundle that tests may change, as a rotation
// or a trust bundle update would.
type svidSource struct {
	mu     sync.Mutex
	svid   *x509svid.SVID
	bundle *x509bundle.Bundle
}

func newSource(t testing.TB, ca *devca.CA, l devca.Leaf) *svidSource {
	t.Helper()
	issued, err := ca.Issue(l)
	if err != nil {
		t.Fatal(err)
	}
	svid, err := x509svid.Parse(issued.CertPEM, issued.KeyPEM)
	if err != nil {
		t.Fatal(err)
	}
	return &svidSource{svid: svid, bundle: x509bundle.FromX509Authorities(spiffeid.RequireTrustDomainFromString(testTD), []*x509.Certificate{ca.Cert})}
}

func (s *svidSource) GetX509SVID() (*x509svid.SVID, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.svid, nil
}

func (s *svidSource) GetX509BundleForTrustDomain(td spiffeid.TrustDomain) (*x509bundle.Bundle, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.bundle.GetX509BundleForTrustDomain(td)
}

// trustOnly replaces the bundle with these CAs.
func (s *svidSource) trustOnly(cas ...*devca.CA) {
	var certs []*x509.Certificate
	for _, ca := range cas {
		certs = append(certs, ca.Cert)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.bundle = x509bundle.FromX509Authorities(spiffeid.RequireTrustDomainFromString(testTD), certs)
}

// rawCert is a certificate as an attacker holds it: whatever it says, with
// no go-spiffe parsing in the way.
func rawCert(t testing.TB, ca *devca.CA, l devca.Leaf) tls.Certificate {
	t.Helper()
	issued, err := ca.Issue(l)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := tls.X509KeyPair(issued.CertPEM, issued.KeyPEM)
	if err != nil {
		t.Fatal(err)
	}
	return cert
}

func uris(t testing.TB, raw ...string) []*url.URL {
	t.Helper()
	var out []*url.URL
	for _, r := range raw {
		u, err := url.Parse(r)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, u)
	}
	return out
}

// handshake is the result of one server-side handshake.
type handshake struct {
	info AuthInfo
	err  error
}

// serve runs ServerHandshake on every connection to a loopback listener and
// reports each result. A connection that passed gets one byte and stays
// open until the test ends.
func serve(t testing.TB, creds credentials.TransportCredentials) (string, <-chan handshake) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	results := make(chan handshake, 64)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var open []net.Conn
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			raw, err := lis.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				conn, info, err := creds.ServerHandshake(raw)
				if err != nil {
					raw.Close()
					results <- handshake{err: err}
					return
				}
				mu.Lock()
				open = append(open, conn)
				mu.Unlock()
				conn.Write([]byte{1})
				results <- handshake{info: info.(AuthInfo)}
			}()
		}
	}()
	t.Cleanup(func() {
		lis.Close()
		mu.Lock()
		for _, c := range open {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return lis.Addr().String(), results
}

func next(t testing.TB, results <-chan handshake) handshake {
	t.Helper()
	select {
	case r := <-results:
		return r
	case <-time.After(waitLong):
		t.Fatal("no handshake ended")
		return handshake{}
	}
}

// attackerConfig is a TLS client presenting cert and trusting anything,
// speaking gRPC's ALPN.
func attackerConfig(cert tls.Certificate) *tls.Config {
	return &tls.Config{Certificates: []tls.Certificate{cert}, InsecureSkipVerify: true, NextProtos: []string{"h2"}}
}

// dialAndRead completes a TLS handshake with cfg and reads the server's
// byte: the server's verdict on the client's certificate arrives after the
// client's side of a TLS 1.3 handshake has ended.
func dialAndRead(addr string, cfg *tls.Config) (tls.ConnectionState, error) {
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: waitLong}, "tcp", addr, cfg)
	if err != nil {
		return tls.ConnectionState{}, err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(waitLong))
	_, err = conn.Read(make([]byte, 1))
	return conn.ConnectionState(), err
}

// logBuffer is a slog logger whose lines a test reads.
type logBuffer struct{ testutil.LogBuffer }

func (b *logBuffer) lines() []string {
	s := strings.TrimSpace(b.String())
	if s == "" {
		return nil
	}
	return strings.Split(s, "\n")
}

func (b *logBuffer) logger() *slog.Logger { return slog.New(slog.NewTextHandler(b, nil)) }

// counts is a refusal counter a test reads.
type counts struct {
	mu sync.Mutex
	n  map[Reason]int
}

func (c *counts) count(r Reason) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n = map[Reason]int{}
	}
	c.n[r]++
}

func (c *counts) get(r Reason) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[r]
}

// fakeClock is a clock a test moves by hand.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// findDecorator is the decorator of type T among those creds is made of:
// each wraps the next in a field TransportCredentials.
func findDecorator[T credentials.TransportCredentials](t testing.TB, creds credentials.TransportCredentials) T {
	t.Helper()
	for creds != nil {
		if d, ok := creds.(T); ok {
			return d
		}
		v := reflect.ValueOf(creds)
		if v.Kind() == reflect.Pointer {
			v = v.Elem()
		}
		if v.Kind() != reflect.Struct {
			break
		}
		inner := v.FieldByName("TransportCredentials")
		if !inner.IsValid() {
			break
		}
		creds, _ = inner.Interface().(credentials.TransportCredentials)
	}
	var zero T
	t.Fatalf("no %T among the credentials", zero)
	return zero
}
