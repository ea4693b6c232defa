package tunnel

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/broker/registry"
	"github.com/kcp-dev/tunnel-broker/internal/redact"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// ConnLeg is one tunnel's leg on a data or dial connection
// (docs/protocol.md §3.7), dressed as a server stream for the splice: it
// receives the peer's data frames (whose encoding is a stream's, so they
// pass on as they are), sends the other leg's frames whole, half-closes
// with a close_write, and ends with the end exchange (Finish), which leaves
// the connection idle for its next tunnel, or resets it.
type ConnLeg struct {
	legContext
	conn net.Conn
	// kind is "data_connection" or "dial_connection", for the metrics.
	kind   string
	frames wire.FrameReader
	// buf holds 2 KiB while reads are small, and a data frame's worth
	// while they are large, as a connStream's.
	buf  wire.ReadBuffer
	once sync.Once

	// peerEnded: the peer's end was read, by the splice's reader.
	peerEnded atomic.Bool
	// A read (by the leg's reader) or a write (by its writer) failed, a
	// deadline of the tunnel's end aside: the connection cannot carry
	// another tunnel. Finish reads them once both have stopped.
	readBroken, writeBroken bool
}

// NewConnLeg is the leg of the tunnel conn carries next, once the broker has
// answered the open or the dial on it with OK; kind names the connection's
// kind in the metrics: "data_connection" or "dial_connection".
func NewConnLeg(conn net.Conn, kind string) *ConnLeg {
	l := &ConnLeg{conn: conn, kind: kind}
	l.legContext = newLegContext(l.end)
	return l
}

// end is the tunnel's end, as package abortable's End tells it: a failure
// frees a read blocked on the connection, and a write too unless the peer
// ended the tunnel (it reads and drops until the broker's end, so a write
// to it finishes, and a write cut short would leave TLS unusable). The
// end exchange follows in Finish.
func (l *ConnLeg) end(st *status.Status) {
	l.once.Do(func() {
		if st.Code() != codes.OK {
			now := time.Now()
			_ = l.conn.SetReadDeadline(now)
			if !l.peerEnded.Load() {
				_ = l.conn.SetWriteDeadline(now)
			}
		}
		l.cancel()
	})
}

// errPeerEnded is the peer's end read while the tunnel was carried: the
// caller or agent went away, or the agent's target failed. It does not
// carry the end's status as its own: a caller's end is not a protocol
// error of the caller's, whatever its code. Its message reaches the other
// peer, so it is redacted and cut as an agent's dial failure is: the
// broker trusts neither peer to say only what the other may hear.
type errPeerEnded struct{ end error }

func (e errPeerEnded) Error() string {
	if e.end == nil {
		return "the peer ended the tunnel"
	}
	return "the peer ended the tunnel: " + redact.Text(status.Convert(e.end).Message(), registry.MaxAgentMessage)
}

// RecvMsg reads the next data frame, up to wire.MaxFrame bytes, as a frame
// that owns its buffer; the peer's close_write is io.EOF, as a client's
// CloseSend is on a stream, and its end errPeerEnded. A frame the
// protocol does not allow is an InvalidArgument status.
func (l *ConnLeg) RecvMsg(m any) error {
	f, ok := m.(*wire.Frame)
	if !ok {
		return errors.New("a connection's leg receives only frames")
	}
	for l.frames.Unread() == 0 {
		kind, end, err := l.frames.Next(l.conn)
		if err != nil {
			return l.readFailed(err)
		}
		switch kind {
		case wire.FrameCloseWrite:
			return io.EOF
		case wire.FrameEnd:
			l.peerEnded.Store(true)
			return errPeerEnded{end}
		}
	}
	frame, err := l.buf.ReadData(l.conn, &l.frames)
	if !frame.Empty() {
		*f = frame
		return nil
	}
	if err == nil {
		err = io.ErrNoProgress
	}
	return l.readFailed(err)
}

// readFailed notes a failed read, and makes a frame the protocol does not
// allow the sender's protocol error.
func (l *ConnLeg) readFailed(err error) error {
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		l.readBroken = true
	}
	if errors.Is(err, wire.ErrBadFrame) {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	return err
}

// SendMsg writes a data frame whole, and the other leg's half-close as a
// close_write. A message with data (the caller's early data, sent to an
// agent's leg) is written as a data frame.
func (l *ConnLeg) SendMsg(m any) error {
	var err error
	switch msg := m.(type) {
	case *wire.Frame:
		_, err = msg.WriteFrame(l.conn)
		msg.Free()
	case interface {
		GetData() []byte
		GetCloseWrite() *tunnelv1.CloseWrite
	}:
		switch {
		case len(msg.GetData()) > 0:
			_, err = l.conn.Write(wire.AppendData(nil, msg.GetData()))
		case msg.GetCloseWrite() != nil:
			err = wire.WriteCloseWrite(l.conn)
		default:
			return errors.New("a connection's leg sends only data and close_write")
		}
	default:
		return errors.New("a connection's leg sends only data and close_write")
	}
	if err != nil {
		l.writeBroken = true
	}
	return err
}

// Finish makes the end exchange once the tunnel has ended and neither
// direction uses the leg any more: it sends the broker's end with st (the
// status of the leg's RPC; nil: OK), and reads and drops what the peer sent
// until its end, within wire.EndTimeout and wire.EndDrain. It says whether
// the connection is idle and fit for the next tunnel; if not, Finish has
// reset it.
func (l *ConnLeg) Finish(st error) (reusable bool) {
	// A failure's end, should it come late, comes before what follows.
	l.end(status.Convert(st))
	defer l.buf.Release()
	if err := l.exchange(st); err != nil {
		metrics.ConnectionTunnelsEnded.WithLabelValues(l.kind, "reset").Inc()
		abort(l.conn)
		l.conn.Close()
		return false
	}
	metrics.ConnectionTunnelsEnded.WithLabelValues(l.kind, "idle").Inc()
	return true
}

// exchange sends the end and awaits the peer's; an error says why the
// connection cannot carry another tunnel.
func (l *ConnLeg) exchange(st error) error {
	switch {
	case l.readBroken:
		return errors.New("a read failed")
	case l.writeBroken:
		return errors.New("a write failed")
	}
	if err := l.conn.SetDeadline(time.Time{}); err != nil {
		return err
	}
	if err := wire.WriteEnd(l.conn, st); err != nil {
		return err
	}
	if l.peerEnded.Load() {
		return nil
	}
	if err := l.conn.SetReadDeadline(time.Now().Add(wire.EndTimeout)); err != nil {
		return err
	}
	if err := l.awaitPeerEnd(); err != nil {
		return err
	}
	return l.conn.SetReadDeadline(time.Time{})
}

// awaitPeerEnd reads and drops the tunnel's data until the peer's end, at
// most wire.EndDrain bytes of it.
func (l *ConnLeg) awaitPeerEnd() error {
	var drop [4 << 10]byte
	dropped := 0
	for {
		if l.frames.Unread() > 0 {
			n, err := l.frames.Read(l.conn, drop[:])
			if dropped += n; err != nil || dropped > wire.EndDrain {
				return fmt.Errorf("dropping data before the peer's end: %d bytes, %v", dropped, err)
			}
			continue
		}
		kind, _, err := l.frames.Next(l.conn)
		if err != nil {
			return err
		}
		if kind == wire.FrameEnd {
			return nil
		}
	}
}
