package e2e

import (
	"crypto/tls"
	"io"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"google.golang.org/grpc"

	"github.com/kcp-dev/tunnel-broker/internal/devca"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	"github.com/kcp-dev/tunnel-broker/kcpplugin"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// waitingDialer is kcpplugin's dialer over conn with EarlyData off, as
// harness.Env.Dialer's: DialService waits for the tunnel, and a failed
// dial's status comes from it, where these tests look for it.
func waitingDialer(conn grpc.ClientConnInterface) *kcpplugin.Dialer {
	d := kcpplugin.NewDialer(conn)
	d.EarlyData = false
	return d
}

// roundTrip writes a line to an echo tunnel and reads it back.
func roundTrip(t *testing.T, conn net.Conn, what string) {
	t.Helper()
	msg := []byte(what + "\n")
	if _, err := conn.Write(msg); err != nil {
		t.Fatalf("%s: write: %v", what, err)
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(conn, got); err != nil || string(got) != string(msg) {
		t.Fatalf("%s: read %q, %v", what, got, err)
	}
}

// loadWatched loads SVID files and re-reads them every 20ms.
func loadWatched(t *testing.T, f devca.Files) *identity.FileSource {
	src, err := identity.LoadFiles(identity.Files{Cert: f.Cert, Key: f.Key, Bundle: f.Bundle}, harness.Logger())
	if err != nil {
		t.Fatal(err)
	}
	src.Watch(20 * time.Millisecond)
	t.Cleanup(func() { src.Close() })
	return src
}

// writeAtomically replaces a file in one rename.
func writeAtomically(t *testing.T, path string, data []byte) {
	tmp := filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+".tmp")
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// brokerSerial makes a new TLS connection to the broker and returns the
// serial of the certificate it presented.
func brokerSerial(t *testing.T, env *harness.Env, addr string) string {
	t.Helper()
	src := env.Identity("/kcp")
	conn, err := tls.Dial("tcp", addr, tlsconfig.MTLSClientConfig(src, src, tlsconfig.AuthorizeID(harness.ID("/broker"))))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	return conn.ConnectionState().PeerCertificates[0].SerialNumber.String()
}
