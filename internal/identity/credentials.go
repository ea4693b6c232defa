package identity

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"runtime/debug"
	"time"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"google.golang.org/grpc/credentials"
)

// SVIDSource is what a workload presents and trusts: its SVID and the bundles
// it verifies peers with.
type SVIDSource interface {
	x509svid.Source
	x509bundle.Source
}

// Option tunes the transport credentials.
type Option func(*spiffeCreds)

// ReportRefusals counts and logs failed handshakes (see Refusals).
func ReportRefusals(r *Refusals) Option {
	return func(c *spiffeCreds) { c.refusals = r }
}

// MaxConcurrentHandshakes bounds the server's TLS handshakes in progress;
// n <= 0 means no bound. See handshakeSlots for what happens past it.
func MaxConcurrentHandshakes(n int) Option {
	return func(c *spiffeCreds) {
		if n > 0 {
			c.slots = newHandshakeSlots(n)
		}
	}
}

// CloseExpiredPeers makes the server close a connection once its peer's
// SVID has expired: at once if no RPC is in flight, else when the last one
// ends, at the latest grace after the expiry. Install ExpiryInterceptors
// too, or RPCs are not counted (and the connection closes at the expiry).
func CloseExpiredPeers(grace time.Duration) Option {
	return func(c *spiffeCreds) { c.expiredGrace = &grace }
}

// ServerCredentials is SPIFFE mTLS that admits any peer whose X.509-SVID
// verifies against the source's bundles and that authorize accepts. Which
// peer may do what is decided per RPC from PeerID.
func ServerCredentials(src SVIDSource, authorize tlsconfig.Authorizer, opts ...Option) credentials.TransportCredentials {
	return newCreds(serverConfig(src, authorize), src, authorize, opts)
}

// ClientCredentials is SPIFFE mTLS to a server whose X.509-SVID verifies
// against the source's bundles and whose SPIFFE ID authorize accepts.
func ClientCredentials(src SVIDSource, authorize tlsconfig.Authorizer, opts ...Option) credentials.TransportCredentials {
	return newCreds(tlsconfig.MTLSClientConfig(src, src, authorize), src, authorize, opts)
}

// spiffeCreds are gRPC's TLS credentials (credentials.NewTLS) over a
// go-spiffe tls.Config, with the peer verified in VerifyConnection and an
// AuthInfo of this package's own: the peer's verified SPIFFE ID, never nil,
// and when its SVID expires.
type spiffeCreds struct {
	cfg          *tls.Config // offering "h2" by ALPN
	tls          credentials.TransportCredentials
	refusals     *Refusals
	slots        *handshakeSlots // server only; nil: no bound
	expiredGrace *time.Duration  // server only; nil: expiry does not close connections
}

func newCreds(cfg *tls.Config, bundles x509bundle.Source, authorize tlsconfig.Authorizer, opts []Option) *spiffeCreds {
	c := newSpiffeTLS(cfg, bundles, authorize, opts)
	// "h2" last, as NewTLS would add it; our handshakes (tlsServer,
	// tlsClient) use cfg, NewTLS's only its Info.
	cfg.NextProtos = []string{"h2"}
	c.tls = credentials.NewTLS(cfg)
	return c
}

// newSpiffeTLS is cfg with the peer verified in VerifyConnection, and
// opts: what both gRPC's credentials and TLSServer are made of.
func newSpiffeTLS(cfg *tls.Config, bundles x509bundle.Source, authorize tlsconfig.Authorizer, opts []Option) *spiffeCreds {
	cfg.VerifyPeerCertificate = nil
	cfg.VerifyConnection = verifyPeer(bundles, authorize)
	c := &spiffeCreds{cfg: cfg}
	for _, o := range opts {
		o(c)
	}
	return c
}

// serverConfig is the server side of SPIFFE mTLS. It asks for a
// certificate without crypto/tls requiring one, so that verifyPeer refuses
// a peer without one and says so precisely.
func serverConfig(src SVIDSource, authorize tlsconfig.Authorizer) *tls.Config {
	cfg := tlsconfig.MTLSServerConfig(src, src, authorize)
	cfg.ClientAuth = tls.RequestClientCert
	return cfg
}

func (c *spiffeCreds) ServerHandshake(raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, info, err := c.serverHandshake(raw, func() (net.Conn, credentials.AuthInfo, error) { return c.tlsServer(raw) })
	if err != nil {
		return nil, nil, err
	}
	if c.expiredGrace != nil {
		info.expiry = newExpiryCloser(raw, info.Expires, *c.expiredGrace)
		conn = &expiringConn{Conn: conn, expiry: info.expiry}
	}
	return conn, info, nil
}

// serverHandshake runs a server's handshake on raw, in one of the slots
// of handshakes in progress (MaxConcurrentHandshakes), and reports it if
// it fails (ReportRefusals).
func (c *spiffeCreds) serverHandshake(raw net.Conn, run func() (net.Conn, credentials.AuthInfo, error)) (net.Conn, AuthInfo, error) {
	remote := raw.RemoteAddr().String()
	var s *slot
	if c.slots != nil {
		var err error
		if s, err = c.slots.acquire(raw); err != nil {
			c.refusals.report(remote, err)
			return nil, AuthInfo{}, err
		}
	}
	conn, info, err := c.handshake(run)
	if s != nil {
		c.slots.release(s)
		if err != nil && s.evicted.Load() {
			err = refused(ReasonOverLimit, errEvicted)
		}
	}
	if err != nil {
		c.refusals.report(remote, err)
		return nil, AuthInfo{}, err
	}
	return conn, info, nil
}

func (c *spiffeCreds) ClientHandshake(ctx context.Context, authority string, raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, info, err := c.handshake(func() (net.Conn, credentials.AuthInfo, error) { return c.tlsClient(ctx, authority, raw) })
	if err != nil {
		// gRPC cancels handshakes when the connection is no longer wanted:
		// that refuses nothing.
		if ctx.Err() != context.Canceled {
			c.refusals.report(authority, err)
		}
		return nil, nil, err
	}
	return conn, info, nil
}

// tlsServer is the server's TLS handshake as gRPC's credentials.NewTLS
// makes it. It returns the *tls.Conn itself rather than gRPC's wrapper of
// it; gRPC reads nothing from its wrapper but what net.Conn has.
func (c *spiffeCreds) tlsServer(raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn := tls.Server(raw, c.cfg)
	if err := conn.Handshake(); err != nil {
		conn.Close()
		return nil, nil, err
	}
	return tlsResult(conn)
}

// tlsClient is the client's, likewise. The authority's host goes in the
// SNI, as gRPC sends it, for proxies that route by it; the peer is verified
// by its SPIFFE ID (verifyPeer), never by that name.
func (c *spiffeCreds) tlsClient(ctx context.Context, authority string, raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	cfg := c.cfg.Clone()
	cfg.ServerName = authority
	if host, _, err := net.SplitHostPort(authority); err == nil {
		cfg.ServerName = host
	}
	conn := tls.Client(raw, cfg)
	if err := conn.HandshakeContext(ctx); err != nil {
		conn.Close()
		if _, ok := errors.AsType[tls.RecordHeaderError](err); ok {
			return nil, nil, notGRPC(authority, "it does not speak TLS")
		}
		return nil, nil, err
	}
	if conn.ConnectionState().NegotiatedProtocol == "" {
		conn.Close()
		return nil, nil, notGRPC(authority, "it speaks TLS, but not HTTP/2")
	}
	c2, info, err := tlsResult(conn)
	if err != nil {
		return nil, nil, err
	}
	if conn.ConnectionState().Version < tls.VersionTLS13 {
		return c2, info, nil
	}
	first, err := awaitServer(ctx, conn)
	if err != nil {
		conn.Close()
		return nil, nil, err
	}
	return &primedConn{Conn: conn, first: first}, info, nil
}

// ErrNotGRPC is a server that answered, but not as a gRPC server over TLS
// does: a client pointed at another port of the broker (its metrics port
// serves plain HTTP, its CONNECT port TLS without HTTP/2).
var ErrNotGRPC = errors.New("not a gRPC server over TLS")

func notGRPC(authority, why string) error {
	return fmt.Errorf("%s answered, but %s: %w; is that the broker's --listen port, not its metrics or CONNECT port?", authority, why, ErrNotGRPC)
}

// awaitServer reads the server's first bytes after a TLS 1.3 handshake. In
// TLS 1.3 the client's handshake ends before the server has checked the
// client's certificate: a server that refuses it sends its alert after, and
// closes. Without this wait the refusal would surface as whatever the next
// write or read hits first, often "broken pipe"; with it, a refused
// certificate is the handshake's error, "remote error: tls: bad
// certificate", which the caller can explain (OwnProblem). A gRPC server
// sends its SETTINGS as soon as its handshake is done, so the wait costs no
// round trip of its own.
func awaitServer(ctx context.Context, conn *tls.Conn) ([]byte, error) {
	if deadline, ok := ctx.Deadline(); ok {
		_ = conn.SetReadDeadline(deadline)
	}
	stop := context.AfterFunc(ctx, func() { _ = conn.SetReadDeadline(time.Unix(1, 0)) })
	buf := make([]byte, 512)
	n, err := conn.Read(buf)
	if !stop() {
		// ctx ended (and set a deadline past) while the read waited.
		return nil, ctx.Err()
	}
	if err != nil {
		return nil, err
	}
	_ = conn.SetReadDeadline(time.Time{})
	return buf[:n], nil
}

// primedConn is a client's TLS connection whose first bytes awaitServer has
// read already: Read returns them first. Everything else is the
// *tls.Conn's.
type primedConn struct {
	*tls.Conn
	first []byte
}

func (c *primedConn) Read(b []byte) (int, error) {
	if len(c.first) > 0 {
		n := copy(b, c.first)
		c.first = c.first[n:]
		return n, nil
	}
	return c.Conn.Read(b)
}

// tlsResult is a finished handshake's connection and AuthInfo. As gRPC
// does, it refuses a peer that negotiated no application protocol: ALPN
// is required for HTTP/2 over TLS.
func tlsResult(conn *tls.Conn) (net.Conn, credentials.AuthInfo, error) {
	cs := conn.ConnectionState()
	if cs.NegotiatedProtocol == "" {
		conn.Close()
		return nil, nil, errors.New("credentials: cannot check peer: missing selected ALPN property")
	}
	return conn, credentials.TLSInfo{State: cs, CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.PrivacyAndIntegrity}}, nil
}

// handshake runs a TLS handshake and reads the verified peer. Nothing
// a peer sends may crash the process: a panic in the handshake (a bug in
// a dependency) fails only this handshake.
func (c *spiffeCreds) handshake(run func() (net.Conn, credentials.AuthInfo, error)) (conn net.Conn, info AuthInfo, err error) {
	defer func() {
		if r := recover(); r != nil {
			if conn != nil {
				conn.Close()
			}
			conn, err = nil, refused(ReasonInternal, fmt.Errorf("TLS handshake panicked: %v", r))
			if c.refusals != nil && c.refusals.Log != nil {
				c.refusals.Log.Error("TLS handshake panicked", "panic", r, "stack", string(debug.Stack()))
			}
		}
	}()
	conn, tlsInfo, err := run()
	if err != nil {
		return nil, AuthInfo{}, err
	}
	info, err = newAuthInfo(tlsInfo)
	if err != nil {
		conn.Close()
		return nil, AuthInfo{}, err
	}
	return conn, info, nil
}

func (c *spiffeCreds) Info() credentials.ProtocolInfo { return c.tls.Info() }

// Clone shares everything but gRPC's TLS credentials: the handshake bound
// and the refusal log are the process's.
func (c *spiffeCreds) Clone() credentials.TransportCredentials {
	clone := *c
	clone.tls = c.tls.Clone()
	return &clone
}

//nolint:staticcheck // part of the interface until gRPC removes it
func (c *spiffeCreds) OverrideServerName(name string) error {
	return c.tls.OverrideServerName(name) //nolint:staticcheck
}
