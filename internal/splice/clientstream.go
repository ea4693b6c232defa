package splice

import (
	"context"
	"errors"
	"io"
	"sync"

	"google.golang.org/grpc"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// ClientStreamLeg is the Tunnel stream an agent opened to the broker, as a
// leg. The broker tells of its half-close with a close_write message and
// is told of the agent's by the stream's CloseSend; the RPC's status comes
// once the broker has ended the tunnel on its side.
type ClientStreamLeg struct {
	stream       grpc.ClientStream
	cancelStream context.CancelFunc
	// ctx ends when the stream's own context does (the agent stops, or
	// ends the tunnel), or when the RPC ends with an error after the
	// broker half-closed, when no copier reads the stream any more.
	ctx    context.Context
	cancel context.CancelCauseFunc
	// halfClosed: the broker half-closed, and a goroutine reads the RPC's
	// status (readStatus), which it sends on status.
	halfClosed bool
	status     chan error
	endOnce    sync.Once
}

// ClientStream is the agent's Tunnel stream, opened with ctx, as a leg.
// cancelStream cancels ctx's stream: End calls it.
func ClientStream(ctx context.Context, stream tunnelv1.AgentService_TunnelClient, cancelStream context.CancelFunc) *ClientStreamLeg {
	legCtx, cancel := context.WithCancelCause(ctx)
	return &ClientStreamLeg{stream: stream, cancelStream: cancelStream, ctx: legCtx, cancel: cancel, status: make(chan error, 1)}
}

// errAfterCloseWrite is a broker that sent more after its close_write.
var errAfterCloseWrite = errors.New("protocol error: the broker sent a message after close_write")

// Recv receives the broker's next data frame; its close_write, or the
// RPC's clean end, is io.EOF.
func (l *ClientStreamLeg) Recv(f *wire.Frame) error {
	if err := l.stream.RecvMsg(f); err != nil {
		return err // io.EOF: the RPC ended with OK
	}
	if _, err := f.DataLen(); err == nil {
		return nil
	}
	var msg tunnelv1.TunnelResponse
	err := f.Decode(&msg)
	f.Free()
	if err != nil || msg.GetCloseWrite() == nil {
		return ErrNotData
	}
	l.halfClosed = true
	go l.readStatus()
	return io.EOF
}

// readStatus reads the RPC's status once the broker half-closed: nothing
// else may come. An error ends the leg's context, so that the splice ends
// even while no copier reads the stream.
func (l *ClientStreamLeg) readStatus() {
	var f wire.Frame
	err := l.stream.RecvMsg(&f)
	if err == nil {
		f.Free()
		err = errAfterCloseWrite
	}
	if errors.Is(err, io.EOF) {
		err = nil
	} else {
		l.cancel(err)
	}
	l.status <- err
}

func (l *ClientStreamLeg) Send(f *wire.Frame) error { return l.stream.SendMsg(f) }
func (l *ClientStreamLeg) CloseWrite() error        { return l.stream.CloseSend() }
func (l *ClientStreamLeg) Context() context.Context { return l.ctx }

// End cancels the stream. On a clean end it first waits for the RPC's
// status, so that the broker, which sends it once its side has ended
// cleanly too, does not see the stream cancelled before.
func (l *ClientStreamLeg) End(status error) {
	l.endOnce.Do(func() {
		if status == nil && l.halfClosed {
			select {
			case <-l.status:
			case <-l.ctx.Done():
			}
		}
		l.cancelStream()
		l.cancel(nil)
	})
}
