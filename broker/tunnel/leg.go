package tunnel

import (
	"context"
	"io"
	"net"
	"sync"

	"google.golang.org/grpc"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// Leg is one end of a tunnel as the broker carries it: the caller's (a
// Dial stream, or a connection of the CONNECT front end) or the agent's (a
// Tunnel stream). The splice reads each leg in one goroutine and writes it
// in one other, at the level of data frames.
type Leg interface {
	// Recv receives the peer's next frame into f, which then owns its
	// buffers. It returns io.EOF once the peer has half-closed.
	Recv(f *wire.Frame) error
	// Send sends the data frame f to the peer, and takes its buffers.
	Send(f *wire.Frame) error
	// CloseWrite tells the peer that the other peer half-closed: it will
	// be sent nothing more.
	CloseWrite() error
	// Context ends when the peer has gone: its stream ended, or the leg
	// was ended.
	Context() context.Context
	// End ends the leg with the tunnel's status for it (nil: OK). Recv
	// and Send blocked on the leg return soon after: a connection closes
	// at once (a TCP reset for a failure), and a stream ends when its
	// handler, waiting for this, returns the status.
	End(status error)
}

// The two kinds of leg.
var (
	_ Leg = (*StreamLeg)(nil)
	_ Leg = (*ConnLeg)(nil)
)

// StreamLeg is a gRPC stream as a tunnel's leg: the caller's Dial stream
// or the agent's Tunnel stream. Its RPC's handler waits for the tunnel's
// end (Wait) and returns the leg's status, so that every RPC ends from its
// own handler.
type StreamLeg struct {
	stream     grpc.ServerStream
	closeWrite any // the message that half-closes toward the peer
	ended      chan struct{}
	endOnce    sync.Once
	status     error
}

// CallerStream is the Dial stream of a caller as its tunnel's leg.
func CallerStream(stream grpc.ServerStream) *StreamLeg {
	return newStreamLeg(stream, &tunnelv1.DialResponse{Frame: &tunnelv1.DialResponse_CloseWrite{CloseWrite: &tunnelv1.CloseWrite{}}})
}

// AgentStream is the Tunnel stream of an agent as its tunnel's leg.
func AgentStream(stream grpc.ServerStream) *StreamLeg {
	return newStreamLeg(stream, &tunnelv1.TunnelResponse{Frame: &tunnelv1.TunnelResponse_CloseWrite{CloseWrite: &tunnelv1.CloseWrite{}}})
}

func newStreamLeg(stream grpc.ServerStream, closeWrite any) *StreamLeg {
	return &StreamLeg{stream: stream, closeWrite: closeWrite, ended: make(chan struct{})}
}

func (l *StreamLeg) Recv(f *wire.Frame) error { return l.stream.RecvMsg(f) }
func (l *StreamLeg) Send(f *wire.Frame) error { return l.stream.SendMsg(f) }
func (l *StreamLeg) CloseWrite() error        { return l.stream.SendMsg(l.closeWrite) }
func (l *StreamLeg) Context() context.Context { return l.stream.Context() }

// End lets the leg's handler return status (Wait). Only the first End
// counts.
func (l *StreamLeg) End(status error) {
	l.endOnce.Do(func() {
		l.status = status
		close(l.ended)
	})
}

// Wait waits, in the leg's handler, for the tunnel's end, and returns the
// status the handler returns. A stream that ends first (its peer went
// away) returns at once: the splice notices that too.
func (l *StreamLeg) Wait() error {
	select {
	case <-l.ended:
		return l.status
	case <-l.stream.Context().Done():
		return context.Cause(l.stream.Context())
	}
}

// ConnLeg is a connection that carries a tunnel's bytes as they are (the
// CONNECT front end's client, after its 200) as the tunnel's leg: it
// receives what the connection reads as data frames and writes the
// payload of the frames it is sent; a half-close either way is the
// connection's CloseWrite.
type ConnLeg struct {
	conn net.Conn
	// buf holds 2 KiB while reads are small, so that an idle tunnel holds
	// no more, and at most a data frame's worth (wire.MaxFrame) while they
	// are large.
	buf     wire.ReadBuffer
	ctx     context.Context
	cancel  context.CancelFunc
	endOnce sync.Once
}

// NewConnLeg is conn as a tunnel's leg. The leg owns conn: End closes it.
func NewConnLeg(conn net.Conn) *ConnLeg {
	ctx, cancel := context.WithCancel(context.Background())
	return &ConnLeg{conn: conn, ctx: ctx, cancel: cancel}
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

// Send writes the payload of a data frame.
func (l *ConnLeg) Send(f *wire.Frame) error {
	defer f.Free()
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
