// Package harness starts the tunnel's real parts for end-to-end tests, the
// demo and benchmarks: a dev SPIFFE trust domain, brokers and agents (in
// process or as the built binaries), callers and TLS webhook servers, all on
// loopback.
package harness

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"google.golang.org/grpc"

	"github.com/kcp-dev/tunnel-broker/internal/devca"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	"github.com/kcp-dev/tunnel-broker/kcpplugin"
)

// TrustDomain is the dev trust domain every test identity belongs to.
const TrustDomain = "tunnel.test"

// Env is one test's world: a trust domain and the SVIDs of its workloads.
type Env struct {
	T   T
	Dir string
	CA  *devca.CA

	sources []string
}

// NewEnv makes a fresh trust domain in a temp dir.
func NewEnv(t T) *Env {
	t.Helper()
	ca, err := devca.New("tunnel.test dev CA", TrustDomain)
	if err != nil {
		t.Fatal(err)
	}
	return &Env{T: t, Dir: t.TempDir(), CA: ca}
}

// SVID writes an SVID for a workload named by path (e.g. "/broker") and
// returns its files. Broker SVIDs also name localhost, so that grpcurl can
// verify them.
func (e *Env) SVID(path string) devca.Files {
	e.T.Helper()
	f, err := e.CA.WriteSVID(filepath.Join(e.Dir, "svid", filepath.Base(path)), devca.Leaf{
		SPIFFEID: path,
		DNSNames: []string{"localhost"},
		IPs:      []net.IP{net.IPv4(127, 0, 0, 1)},
	})
	if err != nil {
		e.T.Fatal(err)
	}
	return f
}

// Identity loads an SVID written by SVID.
func (e *Env) Identity(path string) *identity.FileSource {
	e.T.Helper()
	f := e.SVID(path)
	src, err := identity.LoadFiles(identity.Files{Cert: f.Cert, Key: f.Key, Bundle: f.Bundle}, nil)
	if err != nil {
		e.T.Fatal(err)
	}
	return src
}

// ID is the SPIFFE ID of path in the dev trust domain.
func ID(path string) spiffeid.ID {
	return spiffeid.RequireFromPath(spiffeid.RequireTrustDomainFromString(TrustDomain), path)
}

// Dialer is a kcpplugin dialer with the caller identity path (e.g. "/kcp"),
// connected to the broker at addr. The connection closes with the test.
// Its dials wait for their tunnels (EarlyData off), so that a failed dial's
// status comes from DialService, where the tests look for it; a test of
// kcp's default sets EarlyData.
func (e *Env) Dialer(addr, path string) *kcpplugin.Dialer {
	e.T.Helper()
	d := kcpplugin.NewDialer(e.BrokerConn(addr, path))
	d.EarlyData = false
	return d
}

// BrokerConn is a gRPC client connection to the broker at addr, as path.
func (e *Env) BrokerConn(addr, path string) *grpc.ClientConn {
	e.T.Helper()
	src := e.Identity(path)
	// As kcp connects: coalesced writes, 256 KiB flushes, fixed windows.
	conn, err := kcpplugin.NewClient(addr,
		identity.ClientCredentials(src, tlsconfig.AuthorizeMemberOf(src.ID().TrustDomain())))
	if err != nil {
		e.T.Fatal(err)
	}
	e.T.Cleanup(func() { conn.Close() })
	return conn
}

// Eventually polls cond until it holds or the timeout passes.
func Eventually(t T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// T is what the harness needs of a test: testing.TB satisfies it, and so
// does the demo's Main.
type T interface {
	Helper()
	Fatal(args ...any)
	Fatalf(format string, args ...any)
	Cleanup(func())
	TempDir() string
}

// Main is a T for programs: Fatal prints and exits after running cleanups.
type Main struct {
	cleanups []func()
	dirs     []string
}

func (m *Main) Helper() {}

func (m *Main) Fatal(args ...any) {
	fmt.Fprintln(os.Stderr, append([]any{"error:"}, args...)...)
	m.Close()
	os.Exit(1)
}

func (m *Main) Fatalf(format string, args ...any) { m.Fatal(fmt.Sprintf(format, args...)) }

func (m *Main) Cleanup(f func()) { m.cleanups = append(m.cleanups, f) }

func (m *Main) TempDir() string {
	dir, err := os.MkdirTemp("", "tunnel-")
	if err != nil {
		m.Fatal(err)
	}
	m.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// Close runs the cleanups, last first.
func (m *Main) Close() {
	for i := len(m.cleanups) - 1; i >= 0; i-- {
		m.cleanups[i]()
	}
	m.cleanups = nil
}

// Source issues l from ca and loads it, trusting ca's trust domain and, for
// federation, those of also.
func (e *Env) Source(ca *devca.CA, l devca.Leaf, also ...*devca.CA) *identity.FileSource {
	e.T.Helper()
	dir := filepath.Join(e.Dir, "src", fmt.Sprintf("%d", len(e.sources)))
	e.sources = append(e.sources, dir)
	f, err := ca.WriteSVID(dir, l)
	if err != nil {
		e.T.Fatal(err)
	}
	files := identity.Files{Cert: f.Cert, Key: f.Key, Bundle: f.Bundle, Federated: map[string]string{}}
	for i, other := range also {
		path := filepath.Join(dir, fmt.Sprintf("federated-%d.crt", i))
		must(e.T, os.WriteFile(path, other.BundlePEM(), 0o600))
		files.Federated[other.TrustDomain] = path
	}
	src, err := identity.LoadFiles(files, nil)
	if err != nil {
		e.T.Fatal(err)
	}
	return src
}

// ConnWith is a gRPC connection to the broker at addr with src's identity,
// expecting the broker's SPIFFE ID.
func (e *Env) ConnWith(addr string, src identity.SVIDSource) *grpc.ClientConn {
	e.T.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(
		identity.ClientCredentials(src, tlsconfig.AuthorizeID(ID("/broker")))))
	if err != nil {
		e.T.Fatal(err)
	}
	e.T.Cleanup(func() { conn.Close() })
	return conn
}
