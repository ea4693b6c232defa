package brokertest

import (
	"crypto/tls"
	"io"
	"net"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"google.golang.org/grpc"

	"github.com/kcp-dev/tunnel-broker/internal/devca"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// ExpiringPort serves the connections of ALPN protocol with handle on a port
// of their own, whose credentials close a connection once its peer's SVID
// has expired, as the broker's server assembles them (broker/server:
// identity.CloseExpiredPeers under wire.CoalesceWrites and
// identity.Dispatch); the Server's own credentials do not close expired
// peers. A tunnel there has an hour's grace, which outlasts any test: a
// connection that closes at the expiry had none. It returns the port's
// address.
func (s *Server) ExpiringPort(t *testing.T, protocol string, handle func(net.Conn, identity.AuthInfo)) string {
	t.Helper()
	src, err := s.CA.Source(devca.Leaf{SPIFFEID: BrokerPath})
	if err != nil {
		t.Fatal(err)
	}
	creds := wire.CoalesceWrites(identity.ServerCredentials(src, tlsconfig.AuthorizeAny(),
		identity.Protocols(protocol), identity.CloseExpiredPeers(time.Hour)))
	return serve(t, grpc.NewServer(grpc.Creds(identity.Dispatch(creds, map[string]func(net.Conn, identity.AuthInfo){protocol: handle}))))
}

// ConnAs opens a connection of ALPN protocol to addr as src's identity. Its
// reads fail rather than hang past testutil.WaitLong, and read is the
// connection as the broker's side reads one: a socket that ends without a
// close_notify reads wire.ErrNoCloseNotify, not io.EOF.
func ConnAs(t *testing.T, addr string, src *devca.Source, protocol string) (conn *tls.Conn, read io.Reader) {
	t.Helper()
	raw, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	sock := &wire.Socket{Conn: raw}
	cfg := tlsconfig.MTLSClientConfig(src, src, tlsconfig.AuthorizeID(ID(BrokerPath)))
	cfg.NextProtos = []string{protocol}
	conn = tls.Client(sock, cfg)
	t.Cleanup(func() { conn.Close() })
	_ = conn.SetDeadline(time.Now().Add(testutil.WaitLong))
	if err := conn.Handshake(); err != nil {
		t.Fatal(err)
	}
	if got := conn.ConnectionState().NegotiatedProtocol; got != protocol {
		t.Fatalf("the broker negotiated %q, want %q", got, protocol)
	}
	return conn, wire.CloseNotified(conn, sock)
}
