package dial

import (
	"context"
	"sync/atomic"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// errDataBeforeEstablished is the status of a dial whose caller sent a
// frame before the broker answered it.
var errDataBeforeEstablished = status.Error(codes.InvalidArgument,
	"data before established: send nothing after the target until the broker answers the dial (the first bytes may go with the target, as early_data)")

// pendingWatch reads a caller's Dial stream while its dial is pending. A
// caller sends nothing after its target until the broker answers, so a
// frame that comes sooner ends the dial at once: gRPC would otherwise hold
// it, and up to a stream's window (wire.WindowSize) behind it, for as long
// as the dial waits for an agent, counted by no quota. A half-close
// (io.EOF) is no frame: it waits for the splice, as the first thing read
// after the answer does.
type pendingWatch struct {
	// state decides, once, between the answer and a frame that came
	// before it.
	state atomic.Int32
	frame wire.Frame
	read  chan error // the first read's result, once
}

const (
	pending int32 = iota
	answered
	refusedEarly
)

// watchPending starts reading stream, and cancels the returned context,
// derived from ctx, with errDataBeforeEstablished if a frame comes before
// the dial is answered (answer).
func watchPending(ctx context.Context, stream grpc.ServerStream) (*pendingWatch, context.Context, context.CancelFunc) {
	w := &pendingWatch{read: make(chan error, 1)}
	ctx, cancel := context.WithCancelCause(ctx)
	go func() {
		err := stream.RecvMsg(&w.frame)
		if err == nil && w.state.CompareAndSwap(pending, refusedEarly) {
			w.frame.Free()
			cancel(errDataBeforeEstablished)
		}
		w.read <- err
	}()
	return w, ctx, func() { cancel(nil) }
}

// answer marks the dial answered, just before established is sent, unless
// a frame came first: then it returns errDataBeforeEstablished.
func (w *pendingWatch) answer() error {
	if !w.state.CompareAndSwap(pending, answered) {
		return errDataBeforeEstablished
	}
	return nil
}

// refusal is the status of a failed dial: errDataBeforeEstablished if a
// frame came before the answer, else err.
func (w *pendingWatch) refusal(err error) error {
	if w.state.Load() == refusedEarly {
		return errDataBeforeEstablished
	}
	return err
}

// watchedLeg is the caller's stream as its tunnel's leg once the dial is
// answered: its first Recv takes what the watch read.
type watchedLeg struct {
	*tunnel.StreamLeg
	watch *pendingWatch
}

// Recv implements tunnel.Leg. The splice reads a leg from one goroutine.
func (l *watchedLeg) Recv(f *wire.Frame) error {
	if w := l.watch; w != nil {
		l.watch = nil
		err := <-w.read
		*f = w.frame
		return err
	}
	return l.StreamLeg.Recv(f)
}
