package splice

import (
	"context"
	"io"
	"net"
	"sync"
	"time"

	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// ConnLeg is a connection that carries the tunnel's bytes as they are as
// a leg: a CONNECT caller's, after its 200, or an agent's target. It
// receives what the connection reads as data frames and writes the
// payload of the frames it is sent; a half-close either way is the
// connection's CloseWrite.
type ConnLeg struct {
	conn net.Conn
	// writeStall bounds each write: a peer that stops reading would
	// otherwise hold the copier writing to it, and everything the tunnel
	// holds, until it reads again. Zero: no bound.
	writeStall time.Duration
	// buf holds 2 KiB while reads are small, so that an idle tunnel holds
	// no more, and at most a data frame's worth (wire.MaxFrame) while they
	// are large.
	buf     ReadBuffer
	ctx     context.Context
	cancel  context.CancelFunc
	endOnce sync.Once
}

// NewConnLeg is conn as a leg, each write of which must make progress
// within writeStall (zero: no bound). The leg owns conn: End closes it.
func NewConnLeg(conn net.Conn, writeStall time.Duration) *ConnLeg {
	ctx, cancel := context.WithCancel(context.Background())
	return &ConnLeg{conn: conn, writeStall: writeStall, ctx: ctx, cancel: cancel}
}

// Recv reads what the connection has, up to wire.MaxFrame bytes, as a data
// frame that owns its buffer; the end of the connection's reading side is
// io.EOF.
func (l *ConnLeg) Recv(f *wire.Frame) error {
	frame, err := l.buf.ReadFrame(l.conn)
	if !frame.Empty() {
		*f = frame
		return nil
	}
	if err == nil {
		err = io.ErrNoProgress
	}
	// The leg is read no more: its reader holds no pooled buffer.
	l.buf.Release()
	return err
}

// Send writes the payload of a data frame, in one vectored write.
func (l *ConnLeg) Send(f *wire.Frame) error {
	defer f.Free()
	if l.writeStall > 0 {
		// One deadline per write costs a timer update, not a goroutine.
		_ = l.conn.SetWriteDeadline(time.Now().Add(l.writeStall))
	}
	_, err := f.WriteTo(l.conn)
	return err
}

// CloseWrite half-closes the connection, where it can.
func (l *ConnLeg) CloseWrite() error {
	if cw, ok := l.conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// Context ends when the leg is ended: a connection has no other way to
// say that its peer went away than failing a read or a write.
func (l *ConnLeg) Context() context.Context { return l.ctx }

// End closes the connection: a failure (status not nil) resets a TCP
// connection, under TLS too, so that its peer reads an error rather than
// the clean end of a half-close. A Unix socket has no reset: its peer
// reads the end (docs/egress-selector.md).
func (l *ConnLeg) End(status error) {
	l.endOnce.Do(func() {
		if status != nil {
			Reset(l.conn)
		}
		l.conn.Close()
		l.cancel()
	})
}

// Reset closes conn with a TCP reset where there is TCP under it, TLS or
// not: it closes the socket with no linger, before a TLS connection could
// send a close_notify.
func Reset(conn net.Conn) {
	sock := conn
	for {
		if tcp, ok := sock.(interface{ SetLinger(int) error }); ok {
			_ = tcp.SetLinger(0)
			break
		}
		under, ok := sock.(interface{ NetConn() net.Conn })
		if !ok {
			break
		}
		sock = under.NetConn()
	}
	sock.Close()
	conn.Close()
}
