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

// What a caller sends after its target and before established is read and
// held by the broker, counted as early data, up to an early data's worth
// (docs/protocol.md §3.4).

func TestDataBeforeEstablishedReachesTheAgentInOrderAfterTheEarlyData(t *testing.T) {
	b := startBroker(t, config{})
	agent := b.connectAgent(t, "a", "root")
	target := brokertest.Target("root")
	caller, _ := b.StartDialWith(t, kcpPath, target, []byte("hello"))
	for _, p := range []string{"one", "two"} {
		if err := caller.Send(brokertest.DataUp([]byte(p))); err != nil {
			t.Fatal(err)
		}
	}
	if err := caller.CloseSend(); err != nil { // as grpcurl -d does
		t.Fatal(err)
	}
	order := agent.Order(t, target)
	if got := string(order.GetEarlyData()); got != "hello" {
		t.Errorf("the order carries %q, want the early data", got)
	}
	tun, _ := agent.Open(t, order.GetDialId())
	if msg, err := caller.Recv(); err != nil || msg.GetEstablished() == nil {
		t.Fatalf("the caller got %v, %v, want established", msg, err)
	}
	for _, want := range []string{"one", "two"} {
		if msg, err := tun.Recv(); err != nil || string(msg.GetData()) != want {
			t.Fatalf("the agent got %v, %v, want data %q", msg, err, want)
		}
	}
	if msg, err := tun.Recv(); err != nil || msg.GetCloseWrite() == nil {
		t.Fatalf("the agent got %v, %v, want close_write", msg, err)
	}
}

func TestMoreThanAnEarlyDatasWorthBeforeEstablishedIsResourceExhausted(t *testing.T) {
	b := startBroker(t, config{})
	agent := b.connectAgent(t, "a", "root")
	target := brokertest.Target("root")
	caller, _ := b.StartDialWith(t, kcpPath, target, []byte("hello"))
	order := agent.Order(t, target)
	// Together with the early data, one byte over.
	if err := caller.Send(brokertest.DataUp(bytes.Repeat([]byte("x"), wire.MaxEarlyData-len("hello")+1))); err != nil {
		t.Fatal(err)
	}
	_, err := caller.Recv()
	testutil.CheckStatus(t, "Dial", err, codes.ResourceExhausted,
		"a caller may send at most 16384 bytes before established, early data included, each message counting as at least 512: wait for established")
	// The refused dial is no longer pending: its agent cannot open it.
	tun, _ := agent.Open(t, order.GetDialId())
	_, err = tun.Recv()
	testutil.CheckStatus(t, "Tunnel", err, codes.NotFound, "no pending dial")
}

// A caller that sends its bytes one per frame holds no more than one that
// sends them in one: each held frame counts as at least 512 bytes, so 33
// of them are over 16 KiB, not the 16,385 their payloads would take.
func TestTinyFramesBeforeEstablishedCountAsWhatHoldingThemCosts(t *testing.T) {
	b := startBroker(t, config{})
	agent := b.connectAgent(t, "a", "root")
	target := brokertest.Target("root")
	caller, _ := b.StartDial(t, kcpPath, target)
	agent.Order(t, target)
	for range wire.MaxEarlyData/512 + 1 {
		if err := caller.Send(brokertest.DataUp([]byte("x"))); err != nil {
			break // refused already
		}
	}
	_, err := caller.Recv()
	testutil.CheckStatus(t, "Dial", err, codes.ResourceExhausted, "each message counting as at least 512")
}

func TestDataBeforeEstablishedCountsAsItsCallersEarlyData(t *testing.T) {
	// A held frame counts as at least 512 bytes: 12 + 512 are over 520.
	b := startBroker(t, config{maxEarlyDataPerCaller: 520})
	agent := b.connectAgent(t, "a", "root")
	target := brokertest.Target("root")
	b.StartDialWith(t, kcpPath, target, []byte("client hello")) // 12 bytes, pending
	agent.Order(t, target)
	caller, _ := b.StartDial(t, kcpPath, target)
	agent.Order(t, target)
	if err := caller.Send(brokertest.DataUp([]byte("client hello"))); err != nil {
		t.Fatal(err)
	}
	_, err := caller.Recv()
	testutil.CheckStatus(t, "Dial", err, codes.ResourceExhausted,
		"the pending dials of spiffe://example.org/kcp hold 12 bytes of early data, and 512 more would pass its 520")
}

func TestATargetAgainBeforeEstablishedIsInvalidArgument(t *testing.T) {
	b := startBroker(t, config{})
	agent := b.connectAgent(t, "a", "root")
	target := brokertest.Target("root")
	caller, _ := b.StartDial(t, kcpPath, target)
	agent.Order(t, target)
	if err := caller.Send(&tunnelv1.DialRequest{Frame: &tunnelv1.DialRequest_Target{Target: target}}); err != nil {
		t.Fatal(err)
	}
	_, err := caller.Recv()
	testutil.CheckStatus(t, "Dial", err, codes.InvalidArgument, "after the target, a caller may only send non-empty data")
}
