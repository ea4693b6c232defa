package agent

import (
	"fmt"
	"maps"
	"slices"
	"testing"
	"time"

	promtestutil "github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"

	"github.com/kcp-dev/tunnel-broker/broker/authz"
	"github.com/kcp-dev/tunnel-broker/broker/internal/brokertest"
	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

func TestRegisterMakesTheAgentRoutableForItsClusters(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, agentA, "a", "root", "team-a")

	if got, want := b.Registry.AgentsPerCluster(), map[string]int{"root": 1, "team-a": 1}; !maps.Equal(got, want) {
		t.Errorf("agents per cluster %v, want %v", got, want)
	}
	for _, cluster := range []string{"root", "team-a"} {
		stream := b.startDial(t, brokertest.Target(cluster))
		order := a.order(t, brokertest.Target(cluster))
		b.open(t, agentA, order.GetDialId())
		established(t, stream)
	}
}

func TestRegisterRefusesClustersThePolicyDoesNotGive(t *testing.T) {
	b := startBroker(t, config{})
	denied := metrics.Denied.WithLabelValues(authz.AskedServe)
	before := promtestutil.ToFloat64(denied)
	testutil.CheckStatus(t, "agent-b claiming team-a", b.connectStatus(t, agentB, register("root", "team-a")),
		codes.PermissionDenied, `spiffe://example.org/agent-b may not serve logical cluster "team-a"`)
	// An ID without an agent rule may serve nothing.
	testutil.CheckStatus(t, "kcp claiming root", b.connectStatus(t, kcpPath, register("root")),
		codes.PermissionDenied, `spiffe://example.org/kcp may not serve logical cluster "root"`)
	if got := b.Registry.AgentsPerCluster(); len(got) != 0 {
		t.Errorf("refused agents are routed: %v", got)
	}
	if got := promtestutil.ToFloat64(denied) - before; got != 2 {
		t.Errorf("denied_total{asked=serve} rose by %v, want 2", got)
	}
}

func TestRegisterRefusesInvalidClusterNames(t *testing.T) {
	b := startBroker(t, config{})
	for _, name := range []string{"root:org", "Root", "", "-root"} {
		t.Run(fmt.Sprintf("%q", name), func(t *testing.T) {
			// Names are checked before the policy: agent-a may serve
			// root, and the valid name beside the bad one changes nothing.
			testutil.CheckStatus(t, "Connect", b.connectStatus(t, agentA, register("root", name)),
				codes.InvalidArgument, fmt.Sprintf("logical cluster %q is not a valid logical cluster name", name))
		})
	}
}

func TestConnectRefusesAFirstMessageThatIsNotARegistration(t *testing.T) {
	b := startBroker(t, config{})
	for _, tc := range []struct {
		name string
		msg  *tunnelv1.ConnectRequest
	}{
		{"dial failure", &tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_DialFailure{DialFailure: &tunnelv1.DialFailure{DialId: 1}}}},
		{"probe", &tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Probe{Probe: &tunnelv1.Probe{Sequence: 1}}}},
		{"drain", &tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Drain{Drain: &tunnelv1.Drain{}}}},
		{"empty", &tunnelv1.ConnectRequest{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			testutil.CheckStatus(t, "Connect", b.connectStatus(t, agentA, tc.msg),
				codes.InvalidArgument, "the first message on a control stream must be a registration")
		})
	}
	t.Run("closed before a message", func(t *testing.T) {
		testutil.CheckStatus(t, "Connect", b.connectStatus(t, agentA), codes.InvalidArgument, "stream closed before registering")
	})
	t.Run("not a ConnectRequest", func(t *testing.T) {
		err := b.RawStatus(t, agentA, tunnelv1.AgentService_Connect_FullMethodName, brokertest.NotProtobuf)
		testutil.CheckStatus(t, "Connect", err, codes.InvalidArgument, "not a ConnectRequest")
	})
}

func TestConnectRefusesMessagesAnAgentMayNotSend(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, agentA, "a", "root")
	a.send(t, &tunnelv1.ConnectRequest{})
	testutil.CheckStatus(t, "Connect", a.end(t), codes.InvalidArgument, "after registering, an agent may only report dial failures or re-register")
	// The agent is no longer routed once it hears so.
	testutil.CheckStatus(t, "Dial", dialStatus(t, b.startDial(t, brokertest.Target("root"))), codes.Unavailable, `no agent serves logical cluster "root"`)
}

func TestDialFailuresReachTheDialerWithTheAgentsCode(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, agentA, "a", "root")
	for _, tc := range []struct {
		reported, want codes.Code
	}{
		{codes.NotFound, codes.NotFound},
		{codes.Unavailable, codes.Unavailable},
		{codes.DeadlineExceeded, codes.DeadlineExceeded},
		{codes.PermissionDenied, codes.PermissionDenied},
		{codes.ResourceExhausted, codes.ResourceExhausted},
		{codes.InvalidArgument, codes.InvalidArgument},
		{codes.FailedPrecondition, codes.FailedPrecondition},
		// Codes a caller cannot act on mean the agent failed.
		{codes.Internal, codes.Unavailable},
		{codes.Unknown, codes.Unavailable},
		{codes.OK, codes.Unavailable},
		{codes.Code(99), codes.Unavailable},
	} {
		t.Run(tc.reported.String(), func(t *testing.T) {
			stream := b.startDial(t, brokertest.Target("root"))
			order := a.order(t, brokertest.Target("root"))
			a.fail(t, order.GetDialId(), tc.reported, "no service default/webhook")
			testutil.CheckStatus(t, "Dial", dialStatus(t, stream), tc.want,
				"agent a: no service default/webhook")
		})
	}
}

func TestDialFailuresForOtherDialsAreIgnored(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, agentA, "a", "root")
	// The same identity on another control stream, serving nothing.
	other := b.connectAgent(t, agentA, "other")

	stream := b.startDial(t, brokertest.Target("root"))
	order := a.order(t, brokertest.Target("root"))
	a.fail(t, order.GetDialId()+1000, codes.NotFound, "not this dial")
	other.fail(t, order.GetDialId(), codes.NotFound, "not my dial")
	b.open(t, agentA, order.GetDialId())
	established(t, stream)
}

func TestReRegisterChangesRouting(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, agentA, "a", "root")

	a.send(t, register("team-a"))
	testutil.Eventually(t, "the new clusters to be routed", func() bool {
		return maps.Equal(b.Registry.AgentsPerCluster(), map[string]int{"team-a": 1})
	})
	testutil.CheckStatus(t, "Dial root", dialStatus(t, b.startDial(t, brokertest.Target("root"))), codes.Unavailable, `no agent serves logical cluster "root"`)
	// A re-registration is not answered: the next message is the order.
	stream := b.startDial(t, brokertest.Target("team-a"))
	order := a.order(t, brokertest.Target("team-a"))
	b.open(t, agentA, order.GetDialId())
	established(t, stream)

	// A claim the policy refuses ends the registration altogether.
	a.send(t, register("root", "team-b"))
	testutil.CheckStatus(t, "Connect", a.end(t), codes.PermissionDenied, `spiffe://example.org/agent-a may not serve logical cluster "team-b"`)
	testutil.CheckStatus(t, "Dial team-a", dialStatus(t, b.startDial(t, brokertest.Target("team-a"))), codes.Unavailable, `no agent serves logical cluster "team-a"`)
}

func TestAgentEndingItsControlStream(t *testing.T) {
	b := startBroker(t, config{})

	t.Run("closing ends it with OK and unregisters", func(t *testing.T) {
		a := b.connectAgent(t, agentA, "a", "root")
		if err := a.control.CloseSend(); err != nil {
			t.Fatal(err)
		}
		if err := a.end(t); err != nil {
			t.Errorf("Connect ended with %v, want OK", err)
		}
		testutil.CheckStatus(t, "Dial", dialStatus(t, b.startDial(t, brokertest.Target("root"))), codes.Unavailable, `no agent serves logical cluster "root"`)
	})
	t.Run("dials waiting on it fail with Unavailable", func(t *testing.T) {
		a := b.connectAgent(t, agentA, "a", "root")
		stream := b.startDial(t, brokertest.Target("root"))
		a.order(t, brokertest.Target("root"))
		a.cancel()
		testutil.CheckStatus(t, "Dial", dialStatus(t, stream), codes.Unavailable, "agent a went away")
	})
	t.Run("tunnels established go on", func(t *testing.T) {
		a := b.connectAgent(t, agentA, "a", "root")
		stream := b.startDial(t, brokertest.Target("root"))
		order := a.order(t, brokertest.Target("root"))
		tun := b.open(t, agentA, order.GetDialId())
		established(t, stream)
		if err := a.control.CloseSend(); err != nil {
			t.Fatal(err)
		}
		if err := a.end(t); err != nil {
			t.Fatalf("Connect ended with %v, want OK", err)
		}
		if err := tun.Send(&tunnelv1.TunnelRequest{Frame: &tunnelv1.TunnelRequest_Data{Data: []byte("still here")}}); err != nil {
			t.Fatal(err)
		}
		msg, err := stream.Recv()
		if err != nil || string(msg.GetData()) != "still here" {
			t.Fatalf("caller got %v, %v; want the agent's data", msg, err)
		}
	})
}

func TestTunnelRefusesAFirstMessageThatIsNotOpen(t *testing.T) {
	b := startBroker(t, config{})
	t.Run("data", func(t *testing.T) {
		ctx, _ := brokertest.StreamContext(t)
		tun, err := tunnelv1.NewAgentServiceClient(b.Conn(t, agentA)).Tunnel(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := tun.Send(&tunnelv1.TunnelRequest{Frame: &tunnelv1.TunnelRequest_Data{Data: []byte("x")}}); err != nil {
			t.Fatal(err)
		}
		testutil.CheckStatus(t, "Tunnel", tunnelStatus(t, tun), codes.InvalidArgument, "the first message on a tunnel must name its dial")
	})
	t.Run("closed before a message", func(t *testing.T) {
		ctx, _ := brokertest.StreamContext(t)
		tun, err := tunnelv1.NewAgentServiceClient(b.Conn(t, agentA)).Tunnel(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := tun.CloseSend(); err != nil {
			t.Fatal(err)
		}
		testutil.CheckStatus(t, "Tunnel", tunnelStatus(t, tun), codes.InvalidArgument, "stream closed before naming its dial")
	})
	t.Run("not a TunnelRequest", func(t *testing.T) {
		err := b.RawStatus(t, agentA, tunnelv1.AgentService_Tunnel_FullMethodName, brokertest.NotProtobuf)
		testutil.CheckStatus(t, "Tunnel", err, codes.InvalidArgument, "not a TunnelRequest")
	})
}

func TestTunnelForADialNotPendingForThePeerIsNotFound(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, agentA, "a", "root")
	b.connectAgent(t, agentB, "b")

	testutil.CheckStatus(t, "unknown dial", tunnelStatus(t, b.open(t, agentA, 42)),
		codes.NotFound, "no pending dial 42 for spiffe://example.org/agent-a")

	stream := b.startDial(t, brokertest.Target("root"))
	order := a.order(t, brokertest.Target("root"))
	id := order.GetDialId()
	// Another agent cannot take the dial, nor spoil it.
	testutil.CheckStatus(t, "another agent's dial", tunnelStatus(t, b.open(t, agentB, id)),
		codes.NotFound, fmt.Sprintf("no pending dial %d for spiffe://example.org/agent-b", id))
	b.open(t, agentA, id)
	established(t, stream)
	// A dial is claimed once.
	testutil.CheckStatus(t, "dial already claimed", tunnelStatus(t, b.open(t, agentA, id)),
		codes.NotFound, fmt.Sprintf("no pending dial %d for spiffe://example.org/agent-a", id))
}

func TestTunnelForADialThatTimedOutIsNotFound(t *testing.T) {
	b := startBroker(t, config{dialTimeout: 200 * time.Millisecond})
	a := b.connectAgent(t, agentA, "a", "root")
	stream := b.startDial(t, brokertest.Target("root"))
	order := a.order(t, brokertest.Target("root"))
	testutil.CheckStatus(t, "Dial", dialStatus(t, stream), codes.DeadlineExceeded, "agent a did not connect in time")
	testutil.CheckStatus(t, "Tunnel", tunnelStatus(t, b.open(t, agentA, order.GetDialId())),
		codes.NotFound, fmt.Sprintf("no pending dial %d", order.GetDialId()))
}

// probedAgent registers an agent with a broker whose clock the test moves,
// and waits until its probe ticker and its SVID's expiry wait on the clock.
func probedAgent(t *testing.T, every time.Duration) (*broker, *agent, brokertest.Clock) {
	t.Helper()
	clk := brokertest.NewClock()
	b := startBroker(t, config{probeEvery: every, clock: clk})
	a := b.connectAgent(t, agentA, "a", "root")
	clk.WaitForTimers(t, 2)
	return b, a, clk
}

// probe checks that the next message is probe seq.
func (a *agent) probe(t *testing.T, seq uint64) {
	t.Helper()
	msg := a.next(t)
	if got := msg.GetProbe(); got == nil || got.GetSequence() != seq {
		t.Fatalf("got %v, want probe %d", msg, seq)
	}
}

// answer answers probe seq.
func (a *agent) answer(t *testing.T, seq uint64) {
	t.Helper()
	a.send(t, &tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Probe{Probe: &tunnelv1.Probe{Sequence: seq}}})
}

func TestProbesAreAnsweredAndRecorded(t *testing.T) {
	const every = 10 * time.Second
	b, a, clk := probedAgent(t, every)
	reg := b.registered("a")

	// Unanswered probes go on, numbered in sequence.
	clk.Step(every)
	a.probe(t, 1)
	clk.Step(every)
	a.probe(t, 2)
	if v, _ := series(t, "kcp_tunnel_broker_agent_reachable", "a", agentA); v != 0 {
		t.Errorf("reachable = %v with a probe due unanswered, want 0", v)
	}
	clk.Step(every)
	a.probe(t, 3)
	sent := clk.Now()
	clk.Step(250 * time.Millisecond)
	a.answer(t, 3)
	testutil.Eventually(t, "the answer to be recorded", func() bool {
		at, _ := reg.LastProbe()
		return !at.IsZero()
	})
	if at, rtt := reg.LastProbe(); !at.Equal(sent.Add(250*time.Millisecond)) || rtt != 250*time.Millisecond {
		t.Errorf("last probe at %v, rtt %v; want %v, 250ms", at, rtt, sent.Add(250*time.Millisecond))
	}
	if v, _ := series(t, "kcp_tunnel_broker_agent_reachable", "a", agentA); v != 1 {
		t.Errorf("reachable = %v once a probe was answered, want 1", v)
	}
}

func TestStaleProbeAnswersAreNotRecorded(t *testing.T) {
	const every = 10 * time.Second
	b, a, clk := probedAgent(t, every)
	reg := b.registered("a")
	for seq := uint64(1); seq <= 2; seq++ {
		clk.Step(every)
		a.probe(t, seq)
	}
	a.answer(t, 1)
	// Messages are handled in order: once the stream has ended on the bad
	// message after it, the stale answer has been handled.
	a.send(t, &tunnelv1.ConnectRequest{})
	testutil.CheckStatus(t, "Connect", a.end(t), codes.InvalidArgument, "after registering")
	if at, rtt := reg.LastProbe(); !at.IsZero() || rtt != 0 {
		t.Errorf("a stale answer was recorded: %v, %v", at, rtt)
	}
}

func TestDrainingAgentIsUsedOnlyWhenNoOtherServesTheCluster(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, agentA, "a", "root")
	other := b.connectAgent(t, agentB, "b", "root")

	a.send(t, &tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Drain{Drain: &tunnelv1.Drain{GraceMs: 1000}}})
	testutil.Eventually(t, "a to drain", func() bool { return b.registered("a").Draining() })
	// Round-robin would give a every other dial.
	for range 4 {
		stream := b.startDial(t, brokertest.Target("root"))
		var order *tunnelv1.DialOrder
		select {
		case msg := <-a.msgs:
			t.Fatalf("the draining agent got %v", msg)
		case msg := <-other.msgs:
			order = msg.GetDialOrder()
		case <-time.After(testutil.WaitLong):
			t.Fatal("no agent got the dial")
		}
		if order == nil {
			t.Fatal("the other agent got no dial order")
		}
		// NotFound: an Unavailable would be retried on a.
		other.fail(t, order.GetDialId(), codes.NotFound, "no such Service")
		testutil.CheckStatus(t, "Dial", dialStatus(t, stream), codes.NotFound, "agent b: no such Service")
	}

	// Alone, the draining agent still gets dials.
	if err := other.control.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if err := other.end(t); err != nil {
		t.Fatal(err)
	}
	stream := b.startDial(t, brokertest.Target("root"))
	order := a.order(t, brokertest.Target("root"))
	b.open(t, agentA, order.GetDialId())
	established(t, stream)
}

func TestBrokerDrainingAndStoppingReachTheAgent(t *testing.T) {
	b := startBroker(t, config{grace: 1500 * time.Millisecond})
	a := b.connectAgent(t, agentA, "a", "root")
	b.Drain()
	if msg := a.next(t); msg.GetDrain() == nil || msg.GetDrain().GetGraceMs() != 1500 {
		t.Fatalf("got %v, want drain with grace_ms 1500", msg)
	}
	b.Stop()
	testutil.CheckStatus(t, "Connect", a.end(t), codes.Unavailable, "the broker is shutting down")
	if n := len(b.Registry.Agents()); n != 0 {
		t.Errorf("%d agents still registered after the control stream ended", n)
	}
}

func TestReRegistrationsArePacedAndTheLatestListWins(t *testing.T) {
	clk := brokertest.NewClock()
	b := startBroker(t, config{clock: clk})
	a := b.connectAgent(t, agentA, "a", "root")
	clk.WaitForTimers(t, 2) // the probe ticker and the SVID's expiry
	superseded := metrics.LimitsHit.WithLabelValues("reregistrations_superseded")
	before := promtestutil.ToFloat64(superseded)
	clusters := func() []string { return b.Registry.ClustersOf(b.registered("a")) }

	// The first DefaultMaxReregistrationsPerSecond lists are put in force
	// at once, the next one waits for the pace.
	for range DefaultMaxReregistrationsPerSecond / 2 {
		a.send(t, register("team-a"))
		a.send(t, register("root"))
	}
	testutil.Eventually(t, "the burst's last list in force", func() bool { return slices.Equal(clusters(), []string{"root"}) })
	a.send(t, register("team-a"))
	clk.WaitForTimers(t, 3)
	if got := clusters(); !slices.Equal(got, []string{"root"}) {
		t.Errorf("a list beyond the pace was put in force at once: %v", got)
	}
	// Later lists replace the waiting one.
	a.send(t, register("root", "team-a"))
	a.send(t, register("root"))
	a.send(t, register("team-a"))
	testutil.Eventually(t, "the later lists to replace the waiting one", func() bool { return promtestutil.ToFloat64(superseded)-before == 3 })
	if got := clusters(); !slices.Equal(got, []string{"root"}) {
		t.Errorf("clusters %v before the pace allows a change, want [root]", got)
	}
	clk.Step(time.Second / DefaultMaxReregistrationsPerSecond)
	testutil.Eventually(t, "the latest list in force", func() bool { return slices.Equal(clusters(), []string{"team-a"}) })
	testutil.CheckStatus(t, "Dial root", dialStatus(t, b.startDial(t, brokertest.Target("root"))), codes.Unavailable, `no agent serves logical cluster "root"`)
}
