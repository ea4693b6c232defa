package abortable

import (
	"context"
	"errors"
	"fmt"
	"net"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/types/known/emptypb"
)

// checkTimeout bounds Check. In process, the round trip takes far less.
const checkTimeout = 10 * time.Second

// checkService is the service Check serves to itself.
const checkService = "kcp.tunnel.internal.AbortableCheck"

// checkStatus is the status End gives the RPC of Check.
var checkStatus = status.New(codes.Aborted, "ended from outside the handler")

// Check serves one RPC to itself, in process over an in-memory connection,
// and ends it with End while its handler is blocked in Recv, as a tunnel's
// first failure does: the client must get End's status and the blocked Recv
// must return. If not, the grpc-go this binary was built with has dropped
// or changed the method End relies on, and every tunnel would fail at run
// time; Check says so, naming this package and grpc-go's version. The
// broker runs it once at start.
func Check(ctx context.Context) error {
	return check(ctx, checkTimeout)
}

// check is Check with a bound, serving with opts (tests use them to take
// End's method away).
func check(ctx context.Context, timeout time.Duration, opts ...grpc.ServerOption) error {
	if err := endsAnRPC(ctx, timeout, opts...); err != nil {
		return fmt.Errorf("package github.com/kcp-dev/tunnel-broker/broker/internal/abortable does not work with grpc-go %s: %w; "+
			"every tunnel would fail, so the broker does not start (it needs the WriteStatus method of grpc-go's server stream; see that package)",
			grpc.Version, err)
	}
	return nil
}

func endsAnRPC(ctx context.Context, timeout time.Duration, opts ...grpc.ServerOption) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	h := &checkHandler{supported: make(chan bool, 1), freed: make(chan error, 1)}
	conn, stop, err := h.serve(opts...)
	if err != nil {
		return err
	}
	defer stop()
	return h.call(ctx, conn)
}

// checkHandler serves the RPC of Check, and reports what it saw.
type checkHandler struct {
	supported chan bool  // whether the RPC's context holds a stream End can end
	freed     chan error // what the handler's blocked Recv returned
}

// handle ends its RPC with End from another goroutine, as a tunnel's first
// failure does, while it is blocked in Recv.
func (h *checkHandler) handle(_ any, stream grpc.ServerStream) error {
	ok := Supported(stream.Context())
	h.supported <- ok
	if !ok {
		return status.Error(codes.Unimplemented, "End is not supported")
	}
	go End(stream.Context(), checkStatus.Err())
	h.freed <- stream.RecvMsg(new(emptypb.Empty))
	return nil // moot: End has ended the RPC
}

// serve serves the check's RPC with opts on an in-memory listener, and
// returns a client connection to it and what stops both.
func (h *checkHandler) serve(opts ...grpc.ServerOption) (*grpc.ClientConn, func(), error) {
	lis := bufconn.Listen(64 << 10)
	srv := grpc.NewServer(opts...)
	srv.RegisterService(&grpc.ServiceDesc{
		ServiceName: checkService,
		HandlerType: (*any)(nil),
		Streams:     []grpc.StreamDesc{{StreamName: "End", ServerStreams: true, ClientStreams: true, Handler: h.handle}},
	}, struct{}{})
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv.Serve(lis)
	}()
	stopServer := func() {
		srv.Stop()
		<-served
	}
	conn, err := grpc.NewClient("passthrough:///abortable-check",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		stopServer()
		return nil, nil, err
	}
	return conn, func() {
		_ = conn.Close()
		stopServer()
	}, nil
}

// call makes the check's RPC on conn, and checks that End ended it with its
// status and freed the handler's blocked Recv.
func (h *checkHandler) call(ctx context.Context, conn *grpc.ClientConn) error {
	stream, err := conn.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}, "/"+checkService+"/End")
	if err != nil {
		return fmt.Errorf("calling itself: %w", err)
	}
	// The client sends nothing: only End can end the RPC before ctx does.
	got := status.Convert(stream.RecvMsg(new(emptypb.Empty)))
	select {
	case ok := <-h.supported:
		if !ok {
			return errors.New("a handler's context holds no stream with WriteStatus")
		}
	default:
		return fmt.Errorf("the RPC did not reach its handler: %v", got.Err())
	}
	if got.Code() != checkStatus.Code() || got.Message() != checkStatus.Message() {
		return fmt.Errorf("End did not end the RPC: the client got %v, want %v", got.Err(), checkStatus.Err())
	}
	select {
	case err := <-h.freed:
		if err == nil {
			return errors.New("the handler's blocked Recv returned a message after End")
		}
	case <-ctx.Done():
		return errors.New("End did not free the handler's blocked Recv")
	}
	return nil
}
