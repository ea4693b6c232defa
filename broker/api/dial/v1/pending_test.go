package dial

import (
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/kcp-dev/tunnel-broker/broker/internal/brokertest"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
)

// A caller sends nothing after its target until the broker answers: a
// pending dial holds no more of the caller's than its early data.

func TestDataBeforeEstablishedEndsThePendingDial(t *testing.T) {
	// The agent never opens the dial: only the caller's frame can end it
	// before its minute.
	b := startBroker(t, config{timeout: time.Minute})
	a := b.connectAgent(t, "a", "root")
	stream, _ := b.StartDial(t, kcpPath, brokertest.Target("root"))
	a.Order(t, brokertest.Target("root"))
	if err := stream.Send(brokertest.DataUp([]byte("too soon"))); err != nil {
		t.Fatal(err)
	}
	_, err := stream.Recv()
	testutil.CheckStatus(t, "Dial", err, codes.InvalidArgument, "data before established: send nothing after the target until the broker answers")
}

func TestAHalfCloseBeforeEstablishedReachesTheAgentAfterIt(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, "a", "root")
	stream, _ := b.StartDial(t, kcpPath, brokertest.Target("root"))
	if err := stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	order := a.Order(t, brokertest.Target("root"))
	tun, _ := a.Open(t, order.GetDialId())
	if msg, err := stream.Recv(); err != nil || msg.GetEstablished() == nil {
		t.Fatalf("the caller got %v, %v, want established", msg, err)
	}
	if msg, err := tun.Recv(); err != nil || msg.GetCloseWrite() == nil {
		t.Fatalf("the agent got %v, %v, want the caller's close_write", msg, err)
	}
}
