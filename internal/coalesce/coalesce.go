// Package coalesce makes each write gRPC makes under TLS reach the socket
// in one syscall (Writes), for the broker and the agent, whose legs carry
// bulk transfers. kcp's side sends webhook requests and does without it,
// so that the API module kcp pins holds no connection runtime.
package coalesce

import (
	"context"
	"net"
	"sync"
	"sync/atomic"

	"google.golang.org/grpc/credentials"
)

// Writes wraps gRPC transport credentials (TLS, such as SPIFFE
// mTLS) so that each write gRPC makes on a connection they secure reaches
// the socket in one write syscall, however many TLS records it takes.
//
// Why: crypto/tls sends every record, at most 16 KiB of data, with a write
// syscall of its own, so when gRPC flushes a 256 KiB buffer that is sixteen
// syscalls; in bulk transfers over the tunnel they were about a third of the
// broker's CPU. Underneath the TLS connection, the wrapper keeps the records
// of one such write and sends them together. Use it with a write buffer
// larger than gRPC's 32 KiB default, so that one flush carries many records:
//
//	grpc.WithTransportCredentials(coalesce.Writes(creds)),
//	grpc.WithWriteBufferSize(wire.WriteBufferSize),
//
// Everything else is the wrapped credentials': the handshake, the AuthInfo
// (credentials.TLSInfo, from which SPIFFE IDs are read), Info, Clone. Writes
// of one record or less, the handshake, and alerts such as close_notify go
// out as before, in record order. The connections handed to gRPC are no
// longer *tls.Conn; the TLS state is in the AuthInfo, as always.
func Writes(creds credentials.TransportCredentials) credentials.TransportCredentials {
	return &coalescingCreds{TransportCredentials: creds}
}

type coalescingCreds struct {
	credentials.TransportCredentials
}

func (c *coalescingCreds) ClientHandshake(ctx context.Context, authority string, raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	h := &holdConn{Conn: raw}
	conn, info, err := c.TransportCredentials.ClientHandshake(ctx, authority, h)
	if err != nil {
		return conn, info, err
	}
	return &coalescingConn{Conn: conn, hold: h}, info, nil
}

func (c *coalescingCreds) ServerHandshake(raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	h := &holdConn{Conn: raw}
	conn, info, err := c.TransportCredentials.ServerHandshake(h)
	if err != nil {
		return conn, info, err
	}
	return &coalescingConn{Conn: conn, hold: h}, info, nil
}

func (c *coalescingCreds) Clone() credentials.TransportCredentials {
	return &coalescingCreds{TransportCredentials: c.TransportCredentials.Clone()}
}

// maxRecordPayload is the most data a TLS record carries: a Write of no
// more goes out as one record (once crypto/tls is past its first 128 KiB,
// whose records it keeps small), so there is nothing to coalesce.
const maxRecordPayload = 16 << 10

// coalescingConn is the secured connection gRPC writes to. A Write of more
// than one record has the holdConn under it keep what TLS writes, then sends
// it in one piece.
type coalescingConn struct {
	net.Conn // the secured (TLS) connection
	hold     *holdConn
	// wmu makes concurrent large Writes take turns, as tls.Conn does.
	wmu sync.Mutex
	// writing counts large Writes in progress and closed says Close
	// began: each side sets its own and then reads the other's, so that
	// Close sees every Write that does not see it.
	writing atomic.Int32
	closed  atomic.Bool
}

func (c *coalescingConn) Write(p []byte) (int, error) {
	if len(p) <= maxRecordPayload {
		// Its record goes through the holdConn like any other, so it keeps
		// its place even if another Write holds records right now.
		return c.Conn.Write(p)
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.writing.Add(1)
	defer c.writing.Add(-1)
	if c.closed.Load() {
		return 0, net.ErrClosed
	}
	c.hold.start(len(p))
	n, err := c.Conn.Write(p)
	if ferr := c.hold.flush(); ferr != nil && err == nil {
		// The records are lost or cut short on the wire: no byte of p
		// can be said to be written.
		return 0, ferr
	}
	return n, err
}

// Close breaks a Write in progress, as tls.Conn.Close does during one of its
// own: the socket closes at once, without a close_notify, which would have
// to wait for the write. Otherwise it is the TLS connection's Close
// (close_notify, then the socket).
func (c *coalescingConn) Close() error {
	c.closed.Store(true)
	if c.writing.Load() > 0 {
		err := c.hold.Conn.Close()
		c.Conn.Close()
		return err
	}
	return c.Conn.Close()
}

// holdConn is the socket under the TLS connection. Between start and flush
// it keeps what TLS writes instead of sending it; otherwise it sends at
// once. Every write to the socket happens under mu, in the order TLS wrote
// (TLS writes one record at a time), so the record stream stays in order
// whoever writes: a record that comes while records are held joins them, and
// one that comes while they are being sent waits for them.
type holdConn struct {
	net.Conn // the socket
	mu       sync.Mutex
	holding  bool
	held     *[]byte
	// err is the first failed socket write. Records past a failed one
	// would not decrypt, so every later write fails with it too.
	err error
}

// start holds what TLS writes next, about n bytes of data in records.
func (c *holdConn) start(n int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.holding = true
	if c.held == nil {
		c.held = heldBuffers.Get().(*[]byte)
	}
	// Room for the records' headers and tags too (22-29 bytes each with
	// AEAD ciphers); append grows it if that is not enough.
	if want := n + n/64 + 256; cap(*c.held) < want {
		*c.held = make([]byte, 0, want)
	}
}

// flush sends what was held, in one write, and stops holding.
func (c *holdConn) flush() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.holding = false
	if c.held == nil {
		return c.err
	}
	if len(*c.held) > 0 && c.err == nil {
		_, c.err = c.Conn.Write(*c.held)
	}
	if cap(*c.held) <= maxPooledHeld {
		*c.held = (*c.held)[:0]
		heldBuffers.Put(c.held)
	}
	c.held = nil
	return c.err
}

func (c *holdConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err != nil {
		return 0, c.err
	}
	if c.holding {
		*c.held = append(*c.held, p...)
		return len(p), nil
	}
	n, err := c.Conn.Write(p)
	c.err = err
	return n, err
}

// heldBuffers are shared by all connections: one holds a buffer only during
// a large Write, so idle connections hold none, like gRPC's write buffers.
var heldBuffers = sync.Pool{New: func() any { return new([]byte) }}

// maxPooledHeld bounds the buffers kept for reuse: enough for the records of
// a flush of gRPC's write buffer up to nearly 1 MiB.
const maxPooledHeld = 1 << 20
