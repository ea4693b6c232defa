package identity

import (
	"crypto/tls"
	"time"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"google.golang.org/grpc/credentials"

	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// SVIDSource is what a workload presents and trusts: its SVID and the bundles
// it verifies peers with.
type SVIDSource interface {
	x509svid.Source
	x509bundle.Source
}

// Option tunes the transport credentials.
type Option func(*options)

type options struct {
	refusals      *Refusals
	maxHandshakes int
	expiredGrace  *time.Duration
}

// ReportRefusals counts and logs failed handshakes (see Refusals).
func ReportRefusals(r *Refusals) Option {
	return func(o *options) { o.refusals = r }
}

// MaxConcurrentHandshakes bounds the server's TLS handshakes in progress;
// n <= 0 means no bound. See handshakeSlots for what happens past it.
func MaxConcurrentHandshakes(n int) Option {
	return func(o *options) { o.maxHandshakes = n }
}

// CloseExpiredPeers makes the server close a connection once its peer's
// SVID has expired: at once if no RPC is in flight, else when the last one
// ends, at the latest grace after the expiry. Install ExpiryInterceptors
// too, or RPCs are not counted (and the connection closes at the expiry).
func CloseExpiredPeers(grace time.Duration) Option {
	return func(o *options) { o.expiredGrace = &grace }
}

// ServerCredentials is SPIFFE mTLS that admits any peer whose X.509-SVID
// verifies against the source's bundles and that authorize accepts. Which
// peer may do what is decided per RPC from PeerID.
//
// The handshake is gRPC's own; what this package adds wraps it, innermost
// first: the peer read as an AuthInfo, the connection closed when that
// peer's SVID expires, a panic caught, the handshakes in progress bounded,
// and every failure reported.
func ServerCredentials(src SVIDSource, authorize tlsconfig.Authorizer, opts ...Option) credentials.TransportCredentials {
	o := collect(opts)
	creds := withAuthInfo(credentials.NewTLS(serverConfig(src, authorize)))
	if o.expiredGrace != nil {
		creds = closeExpiredPeers(creds, *o.expiredGrace)
	}
	return serverBounds(creds, o)
}

// serverBounds are what every server listener of this package has, gRPC or
// not: a panic fails only its handshake, the handshakes in progress are
// bounded, and failures are reported. The slots are this listener's own.
// The report goes outermost, so that it sees the handshakes turned away or
// evicted for a slot and the panics caught too.
func serverBounds(creds credentials.TransportCredentials, o options) credentials.TransportCredentials {
	creds = guardPanics(creds, o.refusals)
	if o.maxHandshakes > 0 {
		creds = boundHandshakes(creds, newHandshakeSlots(o.maxHandshakes))
	}
	return reportRefusals(creds, o.refusals)
}

// ClientCredentials is SPIFFE mTLS to a server whose X.509-SVID verifies
// against the source's bundles and whose SPIFFE ID authorize accepts.
//
// As on the server, the handshake is gRPC's own, wrapped, innermost first:
// the wait for the server's first bytes, the peer read as an AuthInfo, a
// server that is no gRPC server said so, a panic caught, and every failure
// reported. MaxConcurrentHandshakes and CloseExpiredPeers are the
// server's and do nothing here.
func ClientCredentials(src SVIDSource, authorize tlsconfig.Authorizer, opts ...Option) credentials.TransportCredentials {
	o := collect(opts)
	creds := credentials.NewTLS(clientConfig(src, authorize))
	creds = diagnoseNotGRPC(withAuthInfo(wire.AwaitServer(creds)))
	return reportRefusals(guardPanics(creds, o.refusals), o.refusals)
}

func collect(opts []Option) options {
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	return o
}

// The configurations below are go-spiffe's with two changes: the peer is
// verified in VerifyConnection (see verifyPeer), and the server asks for a
// certificate rather than require one. go-spiffe's
// grpccredentials.MTLS*Credentials, which are credentials.NewTLS over
// these same configurations, cannot take either change: they build the
// tls.Config themselves, and tlsconfig's options only add tracing. So the
// credentials are NewTLS over the changed configurations, and the other
// thing grpccredentials adds, an AuthInfo of its own, is this package's
// instead (withAuthInfo).

// serverConfig is the server side of SPIFFE mTLS, the peer verified by
// verifyPeer. It asks for a certificate without crypto/tls requiring one,
// so that verifyPeer refuses a peer without one and says so precisely.
func serverConfig(src SVIDSource, authorize tlsconfig.Authorizer) *tls.Config {
	cfg := tlsconfig.MTLSServerConfig(src, src, authorize)
	cfg.ClientAuth = tls.RequestClientCert
	return verifiedBy(cfg, verifyPeer(src, authorize))
}

// clientConfig is the client side, the peer verified by verifyPeer; and a
// server that picks no application protocol is refused there, where
// crypto/tls lets this package see it (see diagnoseNotGRPC).
func clientConfig(src SVIDSource, authorize tlsconfig.Authorizer) *tls.Config {
	return verifiedBy(tlsconfig.MTLSClientConfig(src, src, authorize), requireHTTP2(verifyPeer(src, authorize)))
}

// verifiedBy has cfg verify the peer with verify alone, in VerifyConnection
// (see verifyPeer for why not go-spiffe's VerifyPeerCertificate). gRPC
// runs the client's handshake on a goroutine of its own, out of
// guardPanics' reach, so verify catches its own panics.
func verifiedBy(cfg *tls.Config, verify func(tls.ConnectionState) error) *tls.Config {
	cfg.VerifyPeerCertificate = nil
	cfg.VerifyConnection = withoutPanics(verify)
	return cfg
}
