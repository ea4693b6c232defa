package agent

import (
	"maps"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/kcp-dev/tunnel-broker/broker/internal/brokertest"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

func TestRegistrationsPerAgentAreLimited(t *testing.T) {
	b := startBroker(t, config{maxRegistrations: 2})
	b.connectAgent(t, agentA, "a", "root")
	// A control stream that has not registered yet holds its place too.
	ctx, _ := brokertest.StreamContext(t)
	if _, err := tunnelv1.NewAgentServiceClient(b.Conn(t, agentA)).Connect(ctx); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, "the silent stream to be counted", func() bool {
		return b.agents.registrations.Held(brokertest.ID(agentA)) == 2
	})
	testutil.CheckStatus(t, "a third registration", b.connectStatus(t, agentA, register("root")), codes.ResourceExhausted,
		"spiffe://example.org/agent-a already holds 2 registrations with this broker replica, the most an agent may")
	// The limit is per SPIFFE ID.
	b.connectAgent(t, agentB, "b", "root")
}

func TestARegistrationMaySendItsClustersInSeveralMessages(t *testing.T) {
	b := startBroker(t, config{})
	ctx, _ := brokertest.StreamContext(t)
	control, err := tunnelv1.NewAgentServiceClient(b.Conn(t, agentA)).Connect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range []*tunnelv1.ConnectRequest{registerMore("root"), registerMore(), register("team-a")} {
		if err := control.Send(m); err != nil {
			t.Fatal(err)
		}
	}
	if msg, err := control.Recv(); err != nil || msg.GetRegistered() == nil {
		t.Fatalf("registering: %v %v", msg, err)
	}
	if got := b.Registry.AgentsPerCluster(); !maps.Equal(got, map[string]int{"root": 1, "team-a": 1}) {
		t.Fatalf("routed %v, want root and team-a", got)
	}
	// An update in several messages is in force with its last: until then
	// the old set stays.
	for _, m := range []*tunnelv1.ConnectRequest{registerMore("team-a"), registerMore("team-a")} {
		if err := control.Send(m); err != nil {
			t.Fatal(err)
		}
	}
	if err := control.Send(register()); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, "the update to be in force", func() bool {
		return maps.Equal(b.Registry.AgentsPerCluster(), map[string]int{"team-a": 1})
	})
}

func TestARegistrationWhoseLastRegisterNeverComesEnds(t *testing.T) {
	clk := brokertest.NewClock()
	b := startBroker(t, config{registerTimeout: 5 * time.Second, clock: clk})
	ctx, _ := brokertest.StreamContext(t)
	control, err := tunnelv1.NewAgentServiceClient(b.Conn(t, agentA)).Connect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := control.Send(registerMore("root")); err != nil {
		t.Fatal(err)
	}
	clk.WaitForTimers(t, 1)
	clk.Step(5 * time.Second)
	_, err = control.Recv()
	testutil.CheckStatus(t, "Connect", err, codes.DeadlineExceeded, "the registration's clusters did not all arrive within 5s")
	if got := b.Registry.AgentsPerCluster(); len(got) != 0 {
		t.Errorf("routed %v, want nothing", got)
	}
	// Only registers may come while one is incomplete.
	err = b.connectStatus(t, agentA, registerMore("root"), &tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Probe{Probe: &tunnelv1.Probe{}}})
	testutil.CheckStatus(t, "Connect", err, codes.InvalidArgument, "a register with more must be followed by a register")
}

func TestTheClustersOfARegistrationAreLimited(t *testing.T) {
	b := startBroker(t, config{maxClusters: 1})
	err := b.connectStatus(t, agentA, registerMore("root"), register("team-a"))
	testutil.CheckStatus(t, "Connect", err, codes.ResourceExhausted, "a registration may serve at most 1 logical clusters")
	// A cluster named twice counts once.
	b.connectAgent(t, agentA, "a", "root", "root")
}

func TestAgentNamesMustBeDNSLabels(t *testing.T) {
	b := startBroker(t, config{})
	for _, name := range []string{"Upper", "under_score", "-dash", strings.Repeat("n", 64), strings.Repeat("n", 512<<10)} {
		reg := register("root")
		reg.GetRegister().AgentName = name
		err := b.connectStatus(t, agentA, reg)
		testutil.CheckStatus(t, "Connect", err, codes.InvalidArgument, "is not a DNS-1123 label")
		if n := len(err.Error()); n > 400 {
			t.Errorf("a %d-byte name got a %d-byte message", len(name), n)
		}
	}
	b.connectAgent(t, agentA, "us-east-1", "root")
	b.connectAgent(t, agentA, "", "root")
}

func TestAnAgentsSeriesAreDeletedWhenItsRegistrationEnds(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, agentA, "series-end", "root")
	if v, ok := series(t, "kcp_tunnel_broker_agent_reachable", "series-end", agentA); !ok || v != 1 {
		t.Fatalf("reachable = %v (exists: %v), want 1", v, ok)
	}
	a.cancel()
	a.end(t)
	testutil.Eventually(t, "the series to be deleted", func() bool {
		_, ok := series(t, "kcp_tunnel_broker_agent_reachable", "series-end", agentA)
		return !ok
	})
}

func TestAnOldSessionEndingLeavesTheNewSessionsSeries(t *testing.T) {
	b := startBroker(t, config{})
	old := b.connectAgent(t, agentA, "reconnects", "root")
	// The agent reconnects before the broker sees its old stream end.
	fresh := b.connectAgent(t, agentA, "reconnects", "root")
	old.cancel()
	old.end(t)
	testutil.Eventually(t, "the old session to be unregistered", func() bool { return len(b.Registry.Agents()) == 1 })
	if v, ok := series(t, "kcp_tunnel_broker_agent_reachable", "reconnects", agentA); !ok || v != 1 {
		t.Errorf("reachable = %v (exists: %v), want 1 while the new session lives", v, ok)
	}
	fresh.cancel()
	fresh.end(t)
	testutil.Eventually(t, "the series to be deleted", func() bool {
		_, ok := series(t, "kcp_tunnel_broker_agent_reachable", "reconnects", agentA)
		return !ok
	})
}
