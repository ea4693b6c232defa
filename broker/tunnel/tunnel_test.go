package tunnel_test

import (
	"context"
	"errors"
	"io"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/broker/internal/brokertest"
	"github.com/kcp-dev/tunnel-broker/broker/registry"
	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// The hand-over of a tunnel from the agent's Tunnel RPC to the dial, and the
// end of a tunnel that no dial splices.

// handOver dials root through the broker's registry, as the Dial RPC does,
// and has a open its Tunnel RPC for the dial: it returns the tunnel before
// any splice, and the agent's stream.
func (b *broker) handOver(t *testing.T, a *brokertest.Agent) (*tunnel.Tunnel, tunnelv1.AgentService_TunnelClient) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), testutil.WaitLong)
	defer cancel()
	dialed := make(chan *tunnel.Tunnel, 1)
	go func() {
		tun, err := tunnel.Dial(ctx, b.Registry, brokertest.Target("root"), nil)
		if err != nil {
			t.Errorf("dial: %v", err)
		}
		dialed <- tun
	}()
	order := a.Order(t, brokertest.Target("root"))
	stream, _ := a.Open(t, order.GetDialId())
	tun := <-dialed
	if tun == nil {
		t.FailNow()
	}
	return tun, stream
}

// agentOf is the registry's entry of the agent named name.
func (b *broker) agentOf(t *testing.T, name string) *registry.Agent {
	t.Helper()
	for _, a := range b.Registry.Agents() {
		if a.Name == name {
			return a
		}
	}
	t.Fatalf("no agent %s is registered", name)
	return nil
}

func TestATunnelEndedBeforeItsSpliceEndsTheAgentsRPCWithItsStatus(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, "a", "root")
	tun, stream := b.handOver(t, a)
	if tun.ID == "" || tun.Agent != b.agentOf(t, "a") {
		t.Errorf("tunnel %q through %v, want a tunnel id through agent a", tun.ID, tun.Agent)
	}
	if n := tun.Agent.Tunnels(); n != 1 {
		t.Errorf("the agent carries %d tunnels, want 1", n)
	}

	tun.End(status.Error(codes.Aborted, "nobody will splice it"))
	_, err := stream.Recv()
	testutil.CheckStatus(t, "the agent's Tunnel RPC", err, codes.Aborted, "nobody will splice it")
	if n := tun.Agent.Tunnels(); n != 0 {
		t.Errorf("the agent carries %d tunnels after the end, want 0", n)
	}
}

func TestATunnelEndedCleanlyEndsTheAgentsRPCWithOK(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, "a", "root")
	tun, stream := b.handOver(t, a)

	tun.End(nil)
	if _, err := stream.Recv(); !errors.Is(err, io.EOF) {
		t.Errorf("the agent's Tunnel RPC ended with %v, want OK", err)
	}
}

func TestOnlyTheFirstEndOfATunnelCounts(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, "a", "root")
	tun, stream := b.handOver(t, a)

	tun.End(nil)
	tun.End(status.Error(codes.Canceled, "too late"))
	if _, err := stream.Recv(); !errors.Is(err, io.EOF) {
		t.Errorf("the agent's Tunnel RPC ended with %v, want the first End's OK", err)
	}
	if n := tun.Agent.Tunnels(); n != 0 {
		t.Errorf("the agent carries %d tunnels after its only one ended twice, want 0", n)
	}
}

func TestTunnelsCountAgainstTheirAgentUntilTheyEnd(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, "a", "root")
	b.connectAgent(t, "b", "other")
	first, _ := b.handOver(t, a)
	second := a.Establish(t, kcpPath, brokertest.Target("root"))
	if n, m := b.agentOf(t, "a").Tunnels(), b.agentOf(t, "b").Tunnels(); n != 2 || m != 0 {
		t.Fatalf("agents carry %d and %d tunnels, want 2 and 0", n, m)
	}
	first.End(nil)
	if n := b.agentOf(t, "a").Tunnels(); n != 1 {
		t.Errorf("the agent carries %d tunnels after one of two ended, want 1", n)
	}
	second.CloseBoth()
	if n := b.agentOf(t, "a").Tunnels(); n != 0 {
		t.Errorf("the agent carries %d tunnels after both ended, want 0", n)
	}
}
