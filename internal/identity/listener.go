package identity

import (
	"crypto/tls"
	"net"

	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"google.golang.org/grpc/credentials"
)

// TLSServer is the server side of SPIFFE mTLS for a listener that does not
// speak gRPC (the broker's CONNECT front end), with the gRPC listener's
// verification and handshake bounds: it admits any X.509-SVID that
// verifies against the source's bundles, on full and resumed handshakes
// alike, and names a workload, exactly as ServerCredentials does; and
// MaxConcurrentHandshakes and ReportRefusals bound and report its
// handshakes as they do the gRPC listener's (each TLSServer has slots of
// its own). CloseExpiredPeers does not apply. Which peer may do what is
// the caller's to decide.
type TLSServer struct{ c *spiffeCreds }

// NewTLSServer is a TLSServer with src's SVID and bundles.
func NewTLSServer(src SVIDSource, opts ...Option) *TLSServer {
	c := newSpiffeTLS(serverConfig(src, tlsconfig.AuthorizeAny()), src, tlsconfig.AuthorizeAny(), opts)
	c.expiredGrace = nil
	return &TLSServer{c: c}
}

// Handshake runs raw's server handshake, bounded by raw's deadline, and
// returns the TLS connection and the verified peer. Past
// MaxConcurrentHandshakes it fails at once, or the oldest handshake in
// progress, if it has stalled, fails in its place.
func (s *TLSServer) Handshake(raw net.Conn) (net.Conn, AuthInfo, error) {
	return s.c.serverHandshake(raw, func() (net.Conn, credentials.AuthInfo, error) {
		conn := tls.Server(raw, s.c.cfg)
		if err := conn.Handshake(); err != nil {
			conn.Close()
			return nil, nil, err
		}
		return conn, credentials.TLSInfo{State: conn.ConnectionState()}, nil
	})
}
