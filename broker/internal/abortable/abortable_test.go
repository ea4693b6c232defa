package abortable_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/broker/internal/abortable"
	"github.com/kcp-dev/tunnel-broker/broker/internal/brokertest"
	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// handler is a Dial handler that reports its stream's context and what its
// blocked call returned, then returns OK, which End must make moot.
type handler struct {
	tunnelv1.UnimplementedDialServiceServer
	block   func(tunnelv1.DialService_DialServer) error
	started chan context.Context
	freed   chan error
}

func (h *handler) Dial(stream tunnelv1.DialService_DialServer) error {
	if _, err := stream.Recv(); err != nil { // the client's opening message
		return err
	}
	h.started <- stream.Context()
	h.freed <- h.block(stream)
	return nil
}

// serve serves a handler that runs block over brokertest's mTLS, opens one
// Dial stream to it and returns once the handler runs block, with the
// handler's stream context.
func serve(t *testing.T, block func(tunnelv1.DialService_DialServer) error) (context.Context, *handler, tunnelv1.DialService_DialClient) {
	h := &handler{block: block, started: make(chan context.Context, 1), freed: make(chan error, 1)}
	pol := policy.File{
		Agents:  []policy.AgentRule{{ID: brokertest.ID("/agent").String(), Clusters: []string{"*"}}},
		Callers: []policy.CallerRule{{ID: brokertest.ID("/kcp").String()}},
	}
	b := brokertest.Start(t, pol, func(_ *brokertest.Server, srv *grpc.Server) {
		tunnelv1.RegisterDialServiceServer(srv, h)
	})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	stream, err := tunnelv1.NewDialServiceClient(b.Conn(t, "/kcp")).Dial(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Open the stream; the client sends nothing more.
	if err := stream.Send(&tunnelv1.DialRequest{}); err != nil {
		t.Fatal(err)
	}
	return testutil.Wait(t, "handler start", h.started), h, stream
}

// blockInRecv waits for a message that never comes.
func blockInRecv(s tunnelv1.DialService_DialServer) error {
	_, err := s.Recv()
	return err
}

func recvEnd(t *testing.T, stream tunnelv1.DialService_DialClient) error {
	t.Helper()
	for {
		if _, err := stream.Recv(); err != nil {
			return err
		}
	}
}

func TestEndFreesAHandlerBlockedInRecvAndThePeerGetsTheStatus(t *testing.T) {
	ctx, h, stream := serve(t, blockInRecv)
	if !abortable.Supported(ctx) {
		t.Fatal("Supported is false inside a handler")
	}
	abortable.End(ctx, status.Error(codes.Unavailable, "the other side went away"))
	if err := testutil.Wait(t, "blocked Recv", h.freed); err == nil {
		t.Error("the blocked Recv returned no error after End")
	}
	testutil.CheckStatus(t, "client", recvEnd(t, stream), codes.Unavailable, "the other side went away")
}

func TestEndFreesAHandlerBlockedInSend(t *testing.T) {
	ctx, h, stream := serve(t, func(s tunnelv1.DialService_DialServer) error {
		// The client never reads: Send blocks once flow control says so.
		msg := &tunnelv1.DialResponse{Frame: &tunnelv1.DialResponse_Data{Data: make([]byte, 32<<10)}}
		for {
			if err := s.Send(msg); err != nil {
				return err
			}
		}
	})
	select {
	case err := <-h.freed:
		t.Fatalf("Send returned before End: %v", err)
	case <-time.After(100 * time.Millisecond): // blocked, or about to be
	}
	abortable.End(ctx, status.Error(codes.DeadlineExceeded, "idle"))
	if err := testutil.Wait(t, "blocked Send", h.freed); err == nil {
		t.Error("the blocked Send returned no error after End")
	}
	testutil.CheckStatus(t, "client", recvEnd(t, stream), codes.DeadlineExceeded, "idle")
}

func TestEndOnAnEndedRPCChangesNothing(t *testing.T) {
	ctx, h, stream := serve(t, blockInRecv)
	abortable.End(ctx, status.Error(codes.Aborted, "first"))
	abortable.End(ctx, status.Error(codes.Internal, "second"))
	testutil.Wait(t, "blocked Recv", h.freed)
	testutil.CheckStatus(t, "client", recvEnd(t, stream), codes.Aborted, "first")
}

func TestNotSupportedOutsideAnRPC(t *testing.T) {
	if abortable.Supported(context.Background()) {
		t.Error("Supported is true for a context of no RPC")
	}
	abortable.End(context.Background(), errors.New("nothing to end")) // and does not panic
}
