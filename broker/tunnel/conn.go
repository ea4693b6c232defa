package tunnel

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// SpliceConn is Splice for a caller that is a plain connection rather than
// a Dial stream: the CONNECT front end's client, after its 200. The tunnel
// is the same (its limits, its idle timeout, its ends, its metrics); the
// caller's leg reads at most a data frame's worth at a time, and a
// half-close either way is the connection's CloseWrite. The caller's
// status decides nothing on a connection: a failure closes it.
func (t *Tunnel) SpliceConn(conn net.Conn, cfg Config, ended func()) (callerStatus, agentStatus error) {
	c := newConnStream(conn)
	defer c.end(nil)
	return t.Splice(c, cfg, ended)
}

// connStream is a connection that carries a tunnel's bytes as they are (the
// CONNECT front end's client), dressed as a server stream: it receives data
// frames read from the connection and writes the payload of the frames it
// is sent. A failure closes it.
type connStream struct {
	legContext
	conn net.Conn
	// buf holds 2 KiB while reads are small, so that an idle tunnel
	// holds no more, and at most a data frame's worth (wire.MaxFrame,
	// what kcpplugin and the agent send at most) while they are large.
	buf  wire.ReadBuffer
	once sync.Once
}

func newConnStream(conn net.Conn) *connStream {
	c := &connStream{conn: conn}
	c.legContext = newLegContext(c.end)
	return c
}

// end closes the connection and ends the stream's context, once. A
// failure (st not OK) resets a TCP connection under TLS, so that its peer
// reads an error rather than the close_notify of a clean half-close.
func (c *connStream) end(st *status.Status) {
	c.once.Do(func() {
		if st.Code() != codes.OK {
			abort(c.conn)
		}
		c.conn.Close()
		c.cancel()
	})
}

// Reset closes conn with a TCP reset where it is TCP under TLS: its peer
// reads an error, not a clean close.
func Reset(conn net.Conn) {
	abort(conn)
	conn.Close()
}

// abort resets conn where it is TCP under TLS: it closes the socket with
// no linger, before the TLS connection could send a close_notify.
func abort(conn net.Conn) {
	under, ok := conn.(interface{ NetConn() net.Conn })
	if !ok {
		return
	}
	sock := under.NetConn()
	if tcp, ok := sock.(interface{ SetLinger(int) error }); ok {
		_ = tcp.SetLinger(0)
	}
	sock.Close()
}

// RecvMsg reads what the connection has, up to wire.MaxFrame bytes, into a
// data frame that owns its buffer (wire.ReadBuffer.ReadFrame); the end of
// the connection's reading side is io.EOF, as a client's CloseSend is on a
// stream.
func (c *connStream) RecvMsg(m any) error {
	f, ok := m.(*wire.Frame)
	if !ok {
		return errors.New("a connection's leg receives only frames")
	}
	frame, err := c.buf.ReadFrame(c.conn)
	if !frame.Empty() {
		*f = frame
		return nil
	}
	if err == nil {
		err = io.ErrNoProgress
	}
	// The leg has ended: its reader holds no pooled buffer any more.
	c.buf.Release()
	return err
}

// SendMsg writes a data frame's payload to the connection, and answers
// the close_write of the other leg's half-close with the connection's
// CloseWrite. A message with data (the caller's early data, sent to an
// agent's leg) is written as a frame is.
func (c *connStream) SendMsg(m any) error {
	switch msg := m.(type) {
	case *wire.Frame:
		defer msg.Free()
		_, err := msg.WriteTo(c.conn)
		return err
	case interface {
		GetData() []byte
		GetCloseWrite() *tunnelv1.CloseWrite
	}:
		if data := msg.GetData(); len(data) > 0 {
			_, err := c.conn.Write(data)
			return err
		}
		if msg.GetCloseWrite() == nil {
			break
		}
		if cw, ok := c.conn.(interface{ CloseWrite() error }); ok {
			return cw.CloseWrite()
		}
		return nil
	}
	return errors.New("a connection's leg sends only data and close_write")
}

// legContext dresses a connection as a server stream for the splice: its
// context carries a transport stream whose WriteStatus calls end, so that
// package abortable's End frees a read or write blocked on the connection,
// as it frees a blocked gRPC Recv or Send; and a connection has no headers
// or trailers.
type legContext struct {
	ctx    context.Context
	cancel context.CancelFunc
}

func newLegContext(end func(*status.Status)) legContext {
	ctx, cancel := context.WithCancel(context.Background())
	return legContext{ctx: grpc.NewContextWithServerTransportStream(ctx, connTransport{end}), cancel: cancel}
}

func (l legContext) Context() context.Context     { return l.ctx }
func (l legContext) SetHeader(metadata.MD) error  { return nil }
func (l legContext) SendHeader(metadata.MD) error { return nil }
func (l legContext) SetTrailer(metadata.MD)       {}

// connTransport is the grpc.ServerTransportStream of a leg's context, for
// package abortable: its WriteStatus ends the leg.
type connTransport struct{ end func(*status.Status) }

func (connTransport) Method() string               { return "CONNECT" }
func (connTransport) SetHeader(metadata.MD) error  { return nil }
func (connTransport) SendHeader(metadata.MD) error { return nil }
func (connTransport) SetTrailer(metadata.MD) error { return nil }
func (t connTransport) WriteStatus(st *status.Status) error {
	t.end(st)
	return nil
}
