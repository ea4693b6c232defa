package dial

import (
	"fmt"
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

func TestDialRefusesAFirstMessageThatIsNotATarget(t *testing.T) {
	b := startBroker(t, config{})
	b.connectAgent(t, "a", "root")

	t.Run("data first", func(t *testing.T) {
		ctx, _ := brokertest.StreamContext(t)
		stream, err := tunnelv1.NewDialServiceClient(b.Conn(t, kcpPath)).Dial(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := stream.Send(brokertest.DataUp([]byte("x"))); err != nil {
			t.Fatal(err)
		}
		_, err = stream.Recv()
		testutil.CheckStatus(t, "Dial", err, codes.InvalidArgument, "the first message of a dial must name a target")
	})
	t.Run("not a DialRequest", func(t *testing.T) {
		err := b.RawStatus(t, kcpPath, tunnelv1.DialService_Dial_FullMethodName, brokertest.NotProtobuf)
		testutil.CheckStatus(t, "Dial", err, codes.InvalidArgument, "not a DialRequest")
	})
	t.Run("closed before a message", func(t *testing.T) {
		ctx, _ := brokertest.StreamContext(t)
		stream, err := tunnelv1.NewDialServiceClient(b.Conn(t, kcpPath)).Dial(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := stream.CloseSend(); err != nil {
			t.Fatal(err)
		}
		_, err = stream.Recv()
		testutil.CheckStatus(t, "Dial", err, codes.InvalidArgument, "stream closed before naming a target")
	})
}

func TestDialRefusesInvalidTargets(t *testing.T) {
	b := startBroker(t, config{})
	// An agent that serves everything: a refusal can only be the target's.
	b.connectAgent(t, "a", "root", "system:admin")
	for _, tc := range []struct {
		name    string
		target  *tunnelv1.Target
		message string
	}{
		{"cluster path", &tunnelv1.Target{Cluster: "root:org", Namespace: "default", Service: "webhook", Port: 443}, `logical cluster "root:org" is not a valid logical cluster name`},
		{"empty cluster", &tunnelv1.Target{Namespace: "default", Service: "webhook", Port: 443}, `logical cluster "" is not a valid`},
		{"upper-case namespace", &tunnelv1.Target{Cluster: "root", Namespace: "Default", Service: "webhook", Port: 443}, `namespace "Default" is not a DNS-1123 label`},
		{"service starting with a digit", &tunnelv1.Target{Cluster: "root", Namespace: "default", Service: "1webhook", Port: 443}, `service "1webhook" is not a DNS-1035 label`},
		{"port zero", &tunnelv1.Target{Cluster: "root", Namespace: "default", Service: "webhook"}, "port 0 is outside 1-65535"},
		{"port too large", &tunnelv1.Target{Cluster: "root", Namespace: "default", Service: "webhook", Port: 65536}, "port 65536 is outside 1-65535"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			testutil.CheckStatus(t, "Dial", b.dialStatus(t, kcpPath, tc.target), codes.InvalidArgument, tc.message)
		})
	}
}

func TestDialRefusesCallersOutsideTheirClusters(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, "a", "root", "team-a")
	denied := metrics.Denied.WithLabelValues(authz.AskedDial)
	before := promtestutil.ToFloat64(denied)

	testutil.CheckStatus(t, "shard dialing root", b.dialStatus(t, shardPath, brokertest.Target("root")),
		codes.PermissionDenied, `spiffe://example.org/shard may not dial logical cluster "root"`)
	// An ID with no caller rule at all.
	testutil.CheckStatus(t, "agent dialing", b.dialStatus(t, agentPath, brokertest.Target("team-a")),
		codes.PermissionDenied, `spiffe://example.org/agent may not dial logical cluster "team-a"`)
	if got := promtestutil.ToFloat64(denied) - before; got != 2 {
		t.Errorf("denied_total{asked=dial} rose by %v, want 2", got)
	}

	// The same caller reaches the cluster it is allowed.
	tn := a.Establish(t, shardPath, brokertest.Target("team-a"))
	tn.Up("allowed")
}

func TestDialWithoutAnAgentForTheClusterIsUnavailable(t *testing.T) {
	b := startBroker(t, config{})
	b.connectAgent(t, "a", "team-a")
	testutil.CheckStatus(t, "Dial", b.dialStatus(t, kcpPath, brokertest.Target("root")), codes.Unavailable, `no agent serves logical cluster "root"`)
}

func TestDialOrdersTheAgentAndEstablishes(t *testing.T) {
	const timeout = 10 * time.Second
	b := startBroker(t, config{timeout: timeout})
	a := b.connectAgent(t, "a", "root")

	stream, _ := b.StartDial(t, kcpPath, brokertest.Target("root"))
	// The caller may send data before established; the broker keeps it
	// for the agent.
	if err := stream.Send(brokertest.DataUp([]byte("early"))); err != nil {
		t.Fatal(err)
	}
	order := a.Order(t, brokertest.Target("root"))
	if ms := order.GetTimeoutMs(); ms == 0 || ms > uint32(timeout.Milliseconds()) {
		t.Errorf("order's timeout_ms is %d, want in (0, %d]", ms, timeout.Milliseconds())
	}
	tun, _ := a.Open(t, order.GetDialId())
	msg, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if got, want := msg.GetEstablished().GetTunnelId(), fmt.Sprintf("%016x", order.GetDialId()); got != want {
		t.Errorf("established %v, want tunnel id %q", msg, want)
	}
	if n := b.Registry.Agents()[0].Tunnels(); n != 1 {
		t.Errorf("the agent carries %d tunnels, want 1", n)
	}
	got, err := tun.Recv()
	if err != nil || string(got.GetData()) != "early" {
		t.Fatalf("agent got %v, %v; want the data sent before established", got, err)
	}
}

func TestDialTimesOutWhenTheAgentDoesNotOpen(t *testing.T) {
	b := startBroker(t, config{timeout: 200 * time.Millisecond})
	a := b.connectAgent(t, "silent", "root")
	stream, _ := b.StartDial(t, kcpPath, brokertest.Target("root"))
	a.Order(t, brokertest.Target("root")) // and never opened
	_, err := stream.Recv()
	testutil.CheckStatus(t, "Dial", err, codes.DeadlineExceeded, "did not connect in time")
}

func TestDialWhileDrainingIsUnavailable(t *testing.T) {
	b := startBroker(t, config{})
	b.connectAgent(t, "a", "root")
	b.Drain()
	testutil.CheckStatus(t, "Dial", b.dialStatus(t, kcpPath, brokertest.Target("root")), codes.Unavailable, "this broker replica is shutting down: dial another")
}

func TestDialLimitsTunnelsPerCaller(t *testing.T) {
	b := startBroker(t, config{maxTunnelsPerCaller: 1})
	a := b.connectAgent(t, "a", "root", "team-a")

	first := a.Establish(t, kcpPath, brokertest.Target("root"))
	testutil.CheckStatus(t, "second dial", b.dialStatus(t, kcpPath, brokertest.Target("root")),
		codes.ResourceExhausted, "spiffe://example.org/kcp already holds 1 tunnels, the most a caller may")

	// The limit is per caller: another one still dials.
	other := a.Establish(t, shardPath, brokertest.Target("team-a"))
	other.Up("other caller")

	// A tunnel that closed no longer counts by the time its caller hears:
	// its copiers are gone before either leg ends.
	first.CloseBoth()
	again := a.Establish(t, kcpPath, brokertest.Target("root"))
	again.Up("again")
	// One that failed stops counting once its copiers, freed by the end
	// of both legs, have returned.
	again.CancelAgent()
	testutil.CheckStatus(t, "caller", again.CallerEnd(), codes.Unavailable, "tunnel lost on the agent's side")
	testutil.Eventually(t, "the failed tunnel to stop counting", func() bool { return b.dial.cfg.Admission.Held(brokertest.ID(kcpPath)) == 0 })
	a.Establish(t, kcpPath, brokertest.Target("root")).Up("and again")
}

func TestDialsThatHaveNotNamedATargetCountAgainstTheCaller(t *testing.T) {
	b := startBroker(t, config{maxTunnelsPerCaller: 2})
	b.connectAgent(t, "a", "root")
	ctx, _ := brokertest.StreamContext(t)
	for range 2 {
		if _, err := tunnelv1.NewDialServiceClient(b.Conn(t, kcpPath)).Dial(ctx); err != nil {
			t.Fatal(err)
		}
	}
	testutil.Eventually(t, "two dials to be counted", func() bool { return b.dial.cfg.Admission.Held(brokertest.ID(kcpPath)) == 2 })
	testutil.CheckStatus(t, "a dial with a target", b.dialStatus(t, kcpPath, brokertest.Target("root")),
		codes.ResourceExhausted, "already holds 2 tunnels, the most a caller may")
}

// A replica without an agent for the cluster says nothing more: a caller
// may send the dial to another replica (kcpplugin's retry policy). A dial
// its agent failed may have reached the target: the trailer forbids gRPC to
// retry it.
func TestDialTellsTheCallerWhetherAnotherReplicaMayTakeIt(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, "a", "team-a")
	pushback := func(stream tunnelv1.DialService_DialClient) []string {
		if _, err := stream.Recv(); err == nil {
			t.Fatal("the dial was answered, want an error")
		}
		return stream.Trailer().Get("grpc-retry-pushback-ms")
	}

	notHere, _ := b.StartDial(t, kcpPath, brokertest.Target("root"))
	if got := pushback(notHere); len(got) != 0 {
		t.Errorf("no agent here: grpc-retry-pushback-ms %q, want none (retry elsewhere)", got)
	}

	failed, _ := b.StartDial(t, kcpPath, brokertest.Target("team-a"))
	order := a.Order(t, brokertest.Target("team-a"))
	if err := a.Control.Send(&tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_DialFailure{DialFailure: &tunnelv1.DialFailure{
		DialId: order.GetDialId(), Code: int32(codes.Unavailable), Message: "connection refused",
	}}}); err != nil {
		t.Fatal(err)
	}
	if got := pushback(failed); !slices.Equal(got, []string{"-1"}) {
		t.Errorf("dial its agent failed: grpc-retry-pushback-ms %q, want [-1] (no retry)", got)
	}
}
