package wire

import (
	"context"
	"crypto/tls"
	"net"
	"time"

	"google.golang.org/grpc/credentials"
)

// AwaitServer has each of creds' client handshakes end with the server's
// first bytes, after TLS 1.3. In TLS 1.3 the client's handshake ends before
// the server has checked the client's certificate: a server that refuses it
// sends its alert after, and closes. Without this wait the refusal would
// surface as whatever the next write or read hits first, often "broken
// pipe"; with it, a refused certificate is the handshake's error, "remote
// error: tls: bad certificate", which the caller can explain. A gRPC server
// sends its SETTINGS as soon as its handshake is done, so the wait costs no
// round trip of its own. A failure of the wait itself is a
// *FirstBytesError. The broker's, the agent's and kcpplugin's credentials
// all wait so.
func AwaitServer(creds credentials.TransportCredentials) credentials.TransportCredentials {
	return &awaitingCreds{TransportCredentials: creds}
}

// FirstBytesError is why a TLS 1.3 handshake that had finished failed
// while its server's first bytes were awaited (AwaitServer): the server's
// alert, or the connection's end. Its text is the error's own.
type FirstBytesError struct{ Err error }

func (e *FirstBytesError) Error() string { return e.Err.Error() }
func (e *FirstBytesError) Unwrap() error { return e.Err }

type awaitingCreds struct {
	credentials.TransportCredentials
}

func (c *awaitingCreds) ClientHandshake(ctx context.Context, authority string, raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, info, err := c.TransportCredentials.ClientHandshake(ctx, authority, raw)
	if err != nil {
		return nil, nil, err
	}
	// Up to TLS 1.2 the server's verdict is part of the handshake.
	if !AwaitedServer(info) {
		return conn, info, nil
	}
	first, err := readFirst(ctx, conn)
	if err != nil {
		conn.Close()
		return nil, nil, &FirstBytesError{err}
	}
	return &primedConn{Conn: conn, first: first}, info, nil
}

func (c *awaitingCreds) Clone() credentials.TransportCredentials {
	return &awaitingCreds{TransportCredentials: c.TransportCredentials.Clone()}
}

// AwaitedServer reports whether AwaitServer waited for the server's first
// bytes in a handshake that returned info: it does for TLS 1.3.
func AwaitedServer(info credentials.AuthInfo) bool {
	tlsInfo, ok := info.(credentials.TLSInfo)
	return ok && tlsInfo.State.Version >= tls.VersionTLS13
}

// readFirst reads the first bytes conn receives, until ctx ends.
func readFirst(ctx context.Context, conn net.Conn) ([]byte, error) {
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

// primedConn is a client's TLS connection whose first bytes readFirst has
// read already: Read returns them first. Everything else is the
// connection's.
type primedConn struct {
	net.Conn
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
