package dial

import (
	"testing"

	"github.com/kcp-dev/tunnel-broker/broker/internal/brokertest"
)

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
