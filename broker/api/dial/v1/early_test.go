package dial

import (
	"bytes"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/kcp-dev/tunnel-broker/broker/internal/brokertest"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// A caller's early data (sent with its target) reaches the agent once, before
// anything the caller sends after it: in the order for an agent that accepts
// early data, else as the first frame of the agent's Tunnel.

// establishEarly dials the root webhook as kcp with early data "client
// hello" through agent, opens the agent's Tunnel, and checks the caller's
// established.
func establishEarly(t *testing.T, b *broker, agent *brokertest.Agent) (*tunnelv1.DialOrder, *brokertest.Tunnel) {
	t.Helper()
	target := brokertest.Target("root")
	caller, _ := b.StartDialWith(t, kcpPath, target, []byte("client hello"))
	order := agent.Order(t, target)
	tun, _ := agent.Open(t, order.GetDialId())
	if msg, err := caller.Recv(); err != nil || msg.GetEstablished() == nil {
		t.Fatalf("the caller got %v, %v, want established", msg, err)
	}
	return order, &brokertest.Tunnel{Caller: caller, Agent: tun}
}

func TestEarlyDataGoesInTheOrder(t *testing.T) {
	b := startBroker(t, config{})
	order, tun := establishEarly(t, b, b.connectAgent(t, "a", "root"))
	if got := string(order.GetEarlyData()); got != "client hello" {
		t.Errorf("the order carries %q, want the caller's early data", got)
	}
	// The splice must not send it again: the agent's first frame is what
	// the caller sent after it.
	if err := tun.Caller.Send(brokertest.DataUp([]byte("next"))); err != nil {
		t.Fatal(err)
	}
	if msg, err := tun.Agent.Recv(); err != nil || string(msg.GetData()) != "next" {
		t.Errorf("the agent's first frame: %v, %v, want data \"next\"", msg, err)
	}
}

func TestEarlyDataOverItsBoundIsInvalidArgument(t *testing.T) {
	b := startBroker(t, config{})
	b.connectAgent(t, "a", "root")
	caller, _ := b.StartDialWith(t, kcpPath, brokertest.Target("root"), bytes.Repeat([]byte("x"), wire.MaxEarlyData+1))
	_, err := caller.Recv()
	testutil.CheckStatus(t, "Dial", err, codes.InvalidArgument, "a dial's early data may be at most 16384 bytes, not 16385")
}

func TestEarlyDataAnywhereButBesideTheTargetIsInvalidArgument(t *testing.T) {
	b := startBroker(t, config{})
	agent := b.connectAgent(t, "a", "root")

	// Without a target, in the first message.
	ctx, _ := brokertest.StreamContext(t)
	stream, err := tunnelv1.NewDialServiceClient(b.Conn(t, kcpPath)).Dial(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&tunnelv1.DialRequest{EarlyData: []byte("client hello")}); err != nil {
		t.Fatal(err)
	}
	_, err = stream.Recv()
	testutil.CheckStatus(t, "Dial", err, codes.InvalidArgument, "the first message of a dial must name a target")

	// Beside data, after the target: not a data frame, so a protocol error.
	tun := agent.Establish(t, kcpPath, brokertest.Target("root"))
	if err := tun.Caller.Send(&tunnelv1.DialRequest{Frame: &tunnelv1.DialRequest_Data{Data: []byte("x")}, EarlyData: []byte("y")}); err != nil {
		t.Fatal(err)
	}
	testutil.CheckStatus(t, "Dial", tun.CallerEnd(), codes.InvalidArgument, "after the target, a caller may only send non-empty data")
}

func TestEarlyDataOfACallersPendingDialsIsBounded(t *testing.T) {
	b := startBroker(t, config{maxEarlyDataPerCaller: 20})
	agent := b.connectAgent(t, "a", "root", "team-a")
	root, team := brokertest.Target("root"), brokertest.Target("team-a")
	hello := []byte("client hello") // 12 bytes

	first, _ := b.StartDialWith(t, kcpPath, root, hello)
	order := agent.Order(t, root) // pending, and counted
	over, _ := b.StartDialWith(t, kcpPath, root, hello)
	_, err := over.Recv()
	testutil.CheckStatus(t, "a second dial with early data", err, codes.ResourceExhausted,
		"the pending dials of spiffe://example.org/kcp hold 12 bytes of early data, and 12 more would pass its 20: dial without early data, or once fewer dials are pending")

	// A dial without early data, and another caller's, count against
	// nothing the first holds.
	b.StartDialWith(t, kcpPath, root, nil)
	agent.Order(t, root)
	b.StartDialWith(t, shardPath, team, hello)
	agent.Order(t, team)

	// Once the first dial is answered, its early data is the target's.
	agent.Open(t, order.GetDialId())
	if msg, err := first.Recv(); err != nil || msg.GetEstablished() == nil {
		t.Fatalf("the first dial got %v, %v, want established", msg, err)
	}
	b.StartDialWith(t, kcpPath, root, hello)
	agent.Order(t, root)
}

func TestEarlyDataOfAllCallersPendingDialsIsBounded(t *testing.T) {
	b := startBroker(t, config{maxEarlyData: 20})
	agent := b.connectAgent(t, "a", "root", "team-a")
	hello := []byte("client hello")
	b.StartDialWith(t, kcpPath, brokertest.Target("root"), hello)
	agent.Order(t, brokertest.Target("root"))
	over, _ := b.StartDialWith(t, shardPath, brokertest.Target("team-a"), hello)
	_, err := over.Recv()
	testutil.CheckStatus(t, "another caller's dial with early data", err, codes.ResourceExhausted,
		"the broker's pending dials hold 12 bytes of early data, and 12 more would pass its 20")
}
