package identity

import (
	"crypto/tls"

	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"google.golang.org/grpc/credentials"
)

// ServerTLSConfig is the server side of SPIFFE mTLS for a listener that
// does not speak gRPC (the broker's CONNECT front end), verified exactly as
// ServerCredentials verifies gRPC peers: any X.509-SVID that verifies
// against the source's bundles, on full and resumed handshakes alike, and
// names a workload; PeerOf reads the result. Which peer may do what is the
// caller's to decide.
func ServerTLSConfig(src SVIDSource) *tls.Config {
	cfg := tlsconfig.MTLSServerConfig(src, src, tlsconfig.AuthorizeAny())
	cfg.ClientAuth = tls.RequestClientCert
	cfg.VerifyPeerCertificate = nil
	cfg.VerifyConnection = verifyPeer(src, tlsconfig.AuthorizeAny())
	return cfg
}

// PeerOf is what a handshake with ServerTLSConfig established about the
// peer: its SPIFFE ID and when its SVID expires.
func PeerOf(cs tls.ConnectionState) (AuthInfo, error) {
	return newAuthInfo(credentials.TLSInfo{State: cs})
}
