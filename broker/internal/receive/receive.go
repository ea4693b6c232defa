// Package receive reads the control messages of the broker's streams: the
// first message of every stream, and an agent's messages on its control
// stream. Data frames go through package tunnel, undecoded.
//
// A message is received raw (wire.Frame) and decoded here, so that one
// that is not protobuf of the stream's request type is the peer's mistake,
// InvalidArgument with the reason, and not gRPC's Internal.
package receive

import (
	"errors"
	"io"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// message is a request message type M, as a pointer.
type message[M any] interface {
	*M
	proto.Message
}

// Message receives the next message of stream as an M. At the end of the
// stream it returns io.EOF.
func Message[M any, P message[M]](stream grpc.ServerStream) (P, error) {
	var f wire.Frame
	if err := stream.RecvMsg(&f); err != nil {
		return nil, err
	}
	defer f.Free()
	msg := P(new(M))
	if err := f.Decode(msg); err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "not a %s: %v", msg.ProtoReflect().Descriptor().Name(), err)
	}
	return msg, nil
}

// First receives the first message of stream as an M. A stream that ends
// before it is InvalidArgument, with closed as the message.
func First[M any, P message[M]](stream grpc.ServerStream, closed string) (P, error) {
	msg, err := Message[M, P](stream)
	if errors.Is(err, io.EOF) {
		return nil, status.Error(codes.InvalidArgument, closed)
	}
	return msg, err
}

// Before runs recv in a goroutine of its own and returns its error,
// unless stop closes first: then it returns stopped, and the handler,
// returning, ends the stream, which frees the receive (whatever it still
// brings is dropped). grpc-go ends a stream from its handler only, so a
// handler blocked in a receive could not return.
func Before(stop <-chan struct{}, recv func() error) (stopped bool, err error) {
	got := make(chan error, 1)
	go func() { got <- recv() }()
	select {
	case err := <-got:
		return false, err
	case <-stop:
		return true, nil
	}
}

// MessageBefore is Message, unless stop closes first (Before): then it
// returns stopped.
func MessageBefore[M any, P message[M]](stream grpc.ServerStream, stop <-chan struct{}, stopped error) (P, error) {
	var msg P
	halted, err := Before(stop, func() (err error) {
		msg, err = Message[M, P](stream)
		return err
	})
	if halted {
		return nil, stopped
	}
	return msg, err
}
