package identity

import (
	"context"
	"fmt"
	"net"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"
)

// A TLS connection outlives the certificates its handshake verified: a peer
// whose SVID has expired (or been replaced because its identity was taken
// away) could go on using a connection it opened before. The server
// therefore refuses every new RPC from a peer whose SVID has expired
// (ExpiryInterceptors), and closes its connection once its RPCs in flight
// have ended, or at the latest a grace period after the expiry
// (CloseExpiredPeers). Services with long-lived streams end them at the
// expiry themselves (the agent's registration does).
//
// Peers are expected to move to a new connection when their SVID rotates,
// well before it expires; a gRPC client whose connection the server closed
// reconnects with the SVID its source holds then.

// expiryCloser closes one server connection after its peer's SVID
// expires, once its RPCs have ended or their grace period is over.
type expiryCloser struct {
	expires time.Time
	grace   time.Duration
	conn    net.Conn // the raw connection under TLS

	mu      sync.Mutex
	rpcs    int
	expired bool
	done    bool
	timer   *time.Timer
}

func newExpiryCloser(conn net.Conn, expires time.Time, grace time.Duration) *expiryCloser {
	l := &expiryCloser{conn: conn, expires: expires, grace: grace}
	l.mu.Lock()
	l.timer = time.AfterFunc(time.Until(expires), l.expire)
	l.mu.Unlock()
	return l
}

// expire runs at the expiry: the connection closes now if it is idle, else
// when its last RPC ends or the grace period is over.
func (l *expiryCloser) expire() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.done {
		return
	}
	l.expired = true
	if l.rpcs == 0 {
		l.closeLocked()
		return
	}
	l.timer = time.AfterFunc(l.grace, func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		l.closeLocked()
	})
}

// startRPC counts an RPC in; false if the peer's SVID has expired.
func (l *expiryCloser) startRPC() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.expired || !time.Now().Before(l.expires) {
		return false
	}
	l.rpcs++
	return true
}

// endRPC counts an RPC out.
func (l *expiryCloser) endRPC() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.rpcs--
	if l.expired && l.rpcs == 0 {
		l.closeLocked()
	}
}

func (l *expiryCloser) closeLocked() {
	if l.done {
		return
	}
	l.done = true
	l.timer.Stop()
	// gRPC sees the connection fail and ends it; the peer reconnects.
	l.conn.Close()
}

// stop forgets the timers of a connection that closed on its own.
func (l *expiryCloser) stop() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.done = true
	l.timer.Stop()
}

// closeExpiredPeers has each of creds' server connections closed once its
// peer's SVID has expired, by an expiryCloser that the connection's
// AuthInfo carries, so that ExpiryInterceptors can count its RPCs. creds'
// AuthInfo must be this package's (withAuthInfo).
func closeExpiredPeers(creds credentials.TransportCredentials, grace time.Duration) credentials.TransportCredentials {
	return &expiryCreds{TransportCredentials: creds, grace: grace}
}

type expiryCreds struct {
	credentials.TransportCredentials
	grace time.Duration
}

func (c *expiryCreds) ServerHandshake(raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, info, err := c.TransportCredentials.ServerHandshake(raw)
	if err != nil {
		return nil, nil, err
	}
	ai, ok := info.(AuthInfo)
	if !ok {
		conn.Close()
		return nil, nil, fmt.Errorf("handshake returned %T, not an identity.AuthInfo", info)
	}
	// It closes raw, the socket: a peer no longer trusted is sent nothing
	// more, not even a close_notify that could wait on a full send buffer.
	ai.expiry = newExpiryCloser(raw, ai.Expires, c.grace)
	return &expiringConn{Conn: conn, expiry: ai.expiry}, ai, nil
}

func (c *expiryCreds) Clone() credentials.TransportCredentials {
	return &expiryCreds{TransportCredentials: c.TransportCredentials.Clone(), grace: c.grace}
}

// expiringConn is a server connection with an expiryCloser: closing it
// stops the closer's timers, so that nothing of a closed connection lingers
// until its peer's expiry.
type expiringConn struct {
	net.Conn
	expiry *expiryCloser
}

func (c *expiringConn) Close() error {
	c.expiry.stop()
	return c.Conn.Close()
}

// ExpiryInterceptors refuse every RPC from a peer whose SVID has expired,
// with Unauthenticated, and count the RPCs of each connection so that
// CloseExpiredPeers closes it once they are over. Connections secured by
// other credentials pass through.
func ExpiryInterceptors() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
			end, err := beginRPC(ctx)
			if err != nil {
				return nil, err
			}
			defer end()
			return handler(ctx, req)
		}),
		grpc.ChainStreamInterceptor(func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
			end, err := beginRPC(ss.Context())
			if err != nil {
				return err
			}
			defer end()
			return handler(srv, ss)
		}),
	}
}

func beginRPC(ctx context.Context) (end func(), err error) {
	info, ok := Peer(ctx)
	if !ok {
		return func() {}, nil
	}
	return info.begin()
}

// begin counts an RPC of the connection in; it fails if the peer's SVID
// has expired. end counts the RPC out.
func (info AuthInfo) begin() (end func(), err error) {
	if info.expiry == nil {
		if !time.Now().Before(info.Expires) {
			return nil, ExpiredError(info)
		}
		return func() {}, nil
	}
	if !info.expiry.startRPC() {
		return nil, ExpiredError(info)
	}
	return sync.OnceFunc(info.expiry.endRPC), nil
}

// ExpiredError is the status of an RPC refused because the peer's SVID has
// expired.
func ExpiredError(info AuthInfo) error {
	return status.Error(codes.Unauthenticated, fmt.Sprintf("the X.509-SVID of %s expired at %s: reconnect with a current one",
		info.ID, info.Expires.UTC().Format(time.RFC3339)))
}
