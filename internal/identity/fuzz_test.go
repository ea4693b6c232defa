package identity

import (
	"context"
	"crypto/tls"
	"io"
	"net"
	"net/url"
	"strings"
	"sync"
	"testing"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"google.golang.org/grpc/credentials"

	"github.com/kcp-dev/tunnel-broker/internal/devca"
)

// FuzzHandshakeURISAN issues, from a CA both sides trust, a leaf whose URI
// SANs are the fuzzer's, and runs real TLS handshakes with it through the
// credentials both ways: presented by a client to ServerCredentials (the
// broker), and by a server to ClientCredentials (the agent, which by
// default accepts any ID of its trust domain). No certificate content may
// panic either side, and a peer admitted has a verified workload ID that
// gRPC's own TLSInfo agrees with.
func FuzzHandshakeURISAN(f *testing.F) {
	for _, seed := range [][3]string{
		{"example.org", "/kcp", ""},
		{"example.org", "", ""},                              // the trust domain's own ID: panicked both binaries
		{"example.org", "/" + strings.Repeat("a", 3000), ""}, // too long: panicked both binaries
		{strings.Repeat("a", 300), "/x", ""},
		{"example.org", "/a", "spiffe://example.org/b"},
		{"example.org", "/a/", ""},
		{"EXAMPLE.org", "/a", ""},
		{"user@example.org", "/a", ""},
		{"example.org:8443", "/a", ""},
		{"example.org", "/%41", ""},
		{"", "/a", "https://example.org/a"},
	} {
		f.Add(seed[0], seed[1], seed[2])
	}
	ca, err := devca.New("fuzz", "example.org")
	if err != nil {
		f.Fatal(err)
	}
	own := newSource(f, ca, devca.Leaf{SPIFFEID: "/self"})
	pairs := newConnPairs(f)
	server := ServerCredentials(own, tlsconfig.AuthorizeAny())
	client := ClientCredentials(own, tlsconfig.AuthorizeMemberOf(spiffeid.RequireTrustDomainFromString("example.org")))

	f.Fuzz(func(t *testing.T, host, path, extra string) {
		sans := []*url.URL{{Scheme: "spiffe", Host: host, Path: path}}
		if extra != "" {
			u, err := url.Parse(extra)
			if err != nil {
				return
			}
			sans = append(sans, u)
		}
		issued, err := ca.Issue(devca.Leaf{URIs: sans})
		if err != nil {
			return // not a certificate x509 can encode
		}
		cert, err := tls.X509KeyPair(issued.CertPEM, issued.KeyPEM)
		if err != nil {
			return
		}

		// The broker's side: a client presents the leaf.
		ours, theirs := pairs.next(t)
		peer := runPeer(tls.Client(theirs, attackerConfig(cert)))
		conn, info, err := server.ServerHandshake(ours)
		checkAdmitted(t, conn, info, err)
		ours.Close()
		peer.Wait()

		// The agent's side: a server presents the leaf.
		ours, theirs = pairs.next(t)
		peer = runPeer(tls.Server(theirs, &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2"}, ClientAuth: tls.RequireAnyClientCert}))
		conn, info, err = client.ClientHandshake(context.Background(), "broker", ours)
		checkAdmitted(t, conn, info, err)
		ours.Close()
		peer.Wait()
	})
}

// connPairs makes connected pairs of loopback TCP connections. Not
// net.Pipe: its writes wait for a reader, and a side that refuses a
// handshake writes its alert while the other is still writing its flight,
// which a socket's buffers absorb and a pipe does not.
type connPairs struct{ l net.Listener }

func newConnPairs(f *testing.F) *connPairs {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { l.Close() })
	return &connPairs{l: l}
}

func (p *connPairs) next(t *testing.T) (ours, theirs net.Conn) {
	t.Helper()
	theirs, err := net.Dial("tcp", p.l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	ours, err = p.l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	return ours, theirs
}

// runPeer runs the other side's handshake, says something first as a gRPC
// server does (its SETTINGS), then reads until the connection closes.
func runPeer(c *tls.Conn) *sync.WaitGroup {
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer c.Close()
		if c.Handshake() == nil {
			c.Write([]byte{0})
			io.Copy(io.Discard, c)
		}
	}()
	return &wg
}

// checkAdmitted checks what a handshake that passed established.
func checkAdmitted(t *testing.T, conn net.Conn, info credentials.AuthInfo, err error) {
	t.Helper()
	if err != nil {
		return
	}
	defer conn.Close()
	ai, ok := info.(AuthInfo)
	if !ok {
		t.Fatalf("AuthInfo is %T", info)
	}
	if err := ValidateWorkloadID(ai.ID); err != nil {
		t.Fatalf("admitted %q: %v", ai.ID, err)
	}
	if ai.SPIFFEID == nil || ai.SPIFFEID.String() != ai.ID.String() {
		t.Fatalf("admitted %q, but the TLSInfo gRPC reads says %v", ai.ID, ai.SPIFFEID)
	}
	if ai.Expires.IsZero() {
		t.Fatal("admitted without an expiry")
	}
}
