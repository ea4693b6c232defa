package tunnel

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"

	"google.golang.org/grpc"
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

// maxConnRead is the most a read from the connection carries in one data
// frame: what kcpplugin and the agent send at most.
const maxConnRead = 32<<10 - 16

// connStream is a connection dressed as the caller's server stream: it
// receives data frames read from the connection and writes the payload of
// the frames it is sent. Its context carries a transport stream whose
// WriteStatus closes the connection, so package abortable's End frees a
// blocked read, as it frees a blocked gRPC Recv.
type connStream struct {
	conn   net.Conn
	ctx    context.Context
	cancel context.CancelFunc
	buf    []byte
	once   sync.Once
}

func newConnStream(conn net.Conn) *connStream {
	c := &connStream{conn: conn, buf: make([]byte, maxConnRead)}
	ctx, cancel := context.WithCancel(context.Background())
	c.ctx, c.cancel = grpc.NewContextWithServerTransportStream(ctx, connTransport{c}), cancel
	return c
}

// end closes the connection and ends the stream's context, once.
func (c *connStream) end(*status.Status) {
	c.once.Do(func() {
		c.conn.Close()
		c.cancel()
	})
}

func (c *connStream) Context() context.Context     { return c.ctx }
func (c *connStream) SetHeader(metadata.MD) error  { return nil }
func (c *connStream) SendHeader(metadata.MD) error { return nil }
func (c *connStream) SetTrailer(metadata.MD)       {}

// RecvMsg reads what the connection has, up to maxConnRead bytes, into a
// data frame; the end of the connection's reading side is io.EOF, as a
// client's CloseSend is on a stream.
func (c *connStream) RecvMsg(m any) error {
	f, ok := m.(*wire.Frame)
	if !ok {
		return errors.New("a connection's leg receives only frames")
	}
	n, err := c.conn.Read(c.buf)
	if n > 0 {
		*f = wire.NewDataFrame(c.buf[:n])
		return nil
	}
	if err == nil {
		err = io.ErrNoProgress
	}
	return err
}

// SendMsg writes a data frame's payload to the connection, and answers
// the close_write that follows the agent's half-close with the
// connection's CloseWrite.
func (c *connStream) SendMsg(m any) error {
	switch msg := m.(type) {
	case *wire.Frame:
		defer msg.Free()
		_, err := msg.WriteTo(c.conn)
		return err
	case *tunnelv1.DialResponse:
		if msg.GetCloseWrite() == nil {
			return errors.New("a connection's leg sends only data and close_write")
		}
		if cw, ok := c.conn.(interface{ CloseWrite() error }); ok {
			return cw.CloseWrite()
		}
		return nil
	}
	return errors.New("a connection's leg sends only data and close_write")
}

// connTransport is the grpc.ServerTransportStream of a connStream's
// context, for package abortable: its WriteStatus ends the connection.
type connTransport struct{ c *connStream }

func (connTransport) Method() string               { return "CONNECT" }
func (connTransport) SetHeader(metadata.MD) error  { return nil }
func (connTransport) SendHeader(metadata.MD) error { return nil }
func (connTransport) SetTrailer(metadata.MD) error { return nil }
func (t connTransport) WriteStatus(st *status.Status) error {
	t.c.end(st)
	return nil
}
