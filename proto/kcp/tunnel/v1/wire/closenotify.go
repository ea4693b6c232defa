package wire

import (
	"errors"
	"io"
	"net"
	"sync/atomic"
)

// ErrNoCloseNotify is a data or dial connection that ended without a TLS
// close_notify: its peer did not close it cleanly, but crashed, was reset,
// or lost the network. Inside a tunnel frames say how it ends
// (docs/protocol.md §3.7); outside one, the close_notify is a clean close:
// a refusal's (wire.CloseRefused), or a pool's that holds enough spares.
var ErrNoCloseNotify = errors.New("the connection ended without a close_notify")

// Socket is the connection under a data connection's TLS: it remembers
// that it reached its end, which CloseNotified needs.
type Socket struct {
	net.Conn
	ended atomic.Bool
}

func (s *Socket) Read(p []byte) (int, error) {
	n, err := s.Conn.Read(p)
	if err == io.EOF {
		s.ended.Store(true)
	}
	return n, err
}

// SetLinger is the TCP socket's, for a reset.
func (s *Socket) SetLinger(sec int) error {
	if l, ok := s.Conn.(interface{ SetLinger(int) error }); ok {
		return l.SetLinger(sec)
	}
	return errors.ErrUnsupported
}

// CloseNotified is conn, a TLS connection over sock, whose io.EOF means a
// close_notify. crypto/tls also returns io.EOF for a socket that ended
// between two records without one; that is ErrNoCloseNotify here. After a
// close_notify TLS reads nothing more from the socket, so the socket's end
// tells the two apart. It keeps conn's CloseWrite and NetConn.
func CloseNotified(conn net.Conn, sock *Socket) net.Conn {
	return &closeNotified{Conn: conn, sock: sock}
}

type closeNotified struct {
	net.Conn
	sock *Socket
}

func (c *closeNotified) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if err == io.EOF && c.sock.ended.Load() {
		err = ErrNoCloseNotify
	}
	return n, err
}

func (c *closeNotified) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return errors.ErrUnsupported
}

// NetConn is the socket, for a reset (SetLinger).
func (c *closeNotified) NetConn() net.Conn { return c.sock }
