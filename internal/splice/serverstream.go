package splice

import (
	"context"
	"sync"

	"google.golang.org/grpc"

	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// ServerStreamLeg is a gRPC stream the broker serves as a leg: a caller's
// Dial stream or an agent's Tunnel stream. Its peer half-closes by ending
// its side of the stream, and is told of the other's half-close by a
// close_write message. The RPC's handler waits for the splice's end (Wait)
// and returns the leg's status, so that every RPC ends from its own
// handler, which is the only way grpc-go ends a stream.
type ServerStreamLeg struct {
	stream     grpc.ServerStream
	closeWrite any // the message that half-closes toward the peer
	ended      chan struct{}
	endOnce    sync.Once
	status     error
}

// ServerStream is stream as a leg; closeWrite is the response message that
// tells its peer of a half-close.
func ServerStream(stream grpc.ServerStream, closeWrite any) *ServerStreamLeg {
	return &ServerStreamLeg{stream: stream, closeWrite: closeWrite, ended: make(chan struct{})}
}

func (l *ServerStreamLeg) Recv(f *wire.Frame) error { return l.stream.RecvMsg(f) }
func (l *ServerStreamLeg) Send(f *wire.Frame) error { return l.stream.SendMsg(f) }
func (l *ServerStreamLeg) CloseWrite() error        { return l.stream.SendMsg(l.closeWrite) }
func (l *ServerStreamLeg) Context() context.Context { return l.stream.Context() }

// End lets the leg's handler return status (Wait). Only the first End
// counts.
func (l *ServerStreamLeg) End(status error) {
	l.endOnce.Do(func() {
		l.status = status
		close(l.ended)
	})
}

// Wait waits, in the leg's handler, for the splice's end, and returns the
// status the handler returns. A stream that ends first (its peer went
// away) returns at once: the splice notices that too.
func (l *ServerStreamLeg) Wait() error {
	select {
	case <-l.ended:
		return l.status
	case <-l.stream.Context().Done():
		return context.Cause(l.stream.Context())
	}
}
