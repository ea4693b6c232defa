package identity

import (
	"context"
	"crypto/tls"
	"errors"
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
type TLSServer struct {
	creds credentials.TransportCredentials
}

// NewTLSServer is a TLSServer with src's SVID and bundles.
func NewTLSServer(src SVIDSource, opts ...Option) *TLSServer {
	creds := withAuthInfo(plainTLSServer{serverConfig(src, tlsconfig.AuthorizeAny())})
	return &TLSServer{creds: serverBounds(creds, collect(opts))}
}

// Handshake runs raw's server handshake, bounded by raw's deadline, and
// returns the TLS connection and the verified peer. Past
// MaxConcurrentHandshakes it fails at once, or the oldest handshake in
// progress, if it has stalled, fails in its place.
func (s *TLSServer) Handshake(raw net.Conn) (net.Conn, AuthInfo, error) {
	conn, info, err := s.creds.ServerHandshake(raw)
	if err != nil {
		return nil, AuthInfo{}, err
	}
	return conn, info.(AuthInfo), nil
}

// plainTLSServer is crypto/tls's server handshake as transport credentials,
// so that TLSServer is made of the same decorators as ServerCredentials.
// It is not gRPC's NewTLS, which is for HTTP/2 alone: it refuses a client
// that does not offer "h2" by ALPN, as CONNECT's callers do not, and it
// hides the *tls.Conn, whose CloseWrite the CONNECT front end half-closes
// with.
type plainTLSServer struct{ cfg *tls.Config }

func (s plainTLSServer) ServerHandshake(raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn := tls.Server(raw, s.cfg)
	if err := conn.Handshake(); err != nil {
		conn.Close()
		return nil, nil, err
	}
	return conn, credentials.TLSInfo{State: conn.ConnectionState(), CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.PrivacyAndIntegrity}}, nil
}

var errServerOnly = errors.New("a TLSServer has no client side")

func (s plainTLSServer) ClientHandshake(context.Context, string, net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return nil, nil, errServerOnly
}

func (s plainTLSServer) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "tls"}
}

func (s plainTLSServer) Clone() credentials.TransportCredentials { return s }

func (s plainTLSServer) OverrideServerName(string) error { return errServerOnly }
