package opening

import (
	"context"
	"github.com/kcp-dev/tunnel-broker/broker/admission"
	"log/slog"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	agentv1 "github.com/kcp-dev/tunnel-broker/broker/api/agent/v1"
	dialv1 "github.com/kcp-dev/tunnel-broker/broker/api/dial/v1"
	"github.com/kcp-dev/tunnel-broker/broker/internal/brokertest"
	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

const (
	kcpPath   = "/kcp"
	shardPath = "/shard"
	agentPath = "/agent"
)

var testPolicy = policy.File{
	Agents: []policy.AgentRule{{ID: brokertest.ID(agentPath).String(), Clusters: []string{"*"}}},
	Callers: []policy.CallerRule{
		{ID: brokertest.ID(kcpPath).String()},
		{ID: brokertest.ID(shardPath).String()},
	},
}

// startBroker serves the dial and agent services and health behind a guard
// with cfg, and returns both.
func startBroker(t *testing.T, cfg Config) (*Guard, *brokertest.Server) {
	t.Helper()
	cfg.Log = slog.New(slog.DiscardHandler)
	cfg.First = map[string]string{
		tunnelv1.DialService_Dial_FullMethodName:     "target",
		tunnelv1.AgentService_Tunnel_FullMethodName:  "open",
		tunnelv1.AgentService_Connect_FullMethodName: "register",
	}
	g := New(cfg)
	b := brokertest.StartWithOptions(t, testPolicy, g.ServerOptions(), func(s *brokertest.Server, srv *grpc.Server) {
		dialv1.RegisterService(srv, dialv1.New(dialv1.Config{Admission: admission.New(admission.Config{
			Registry: s.Registry, Policy: s.Policy, Timeout: testutil.WaitLong,
			Tunnels: tunnel.Config{Stopping: s.Stopping}, Draining: s.Draining, Log: s.Log,
		})}))
		agentv1.RegisterService(srv, agentv1.New(agentv1.Config{
			Registry: s.Registry, Policy: s.Policy, BrokerID: "test-broker",
			Draining: s.Draining, Stopping: s.Stopping, ProbeEvery: time.Hour, Log: s.Log,
		}))
		healthpb.RegisterHealthServer(srv, health.NewServer())
		g.Methods(srv)
	})
	return g, b
}

// silentStream opens a stream of method as path and sends nothing.
func silentStream(t *testing.T, b *brokertest.Server, path, method string) grpc.ClientStream {
	t.Helper()
	ctx, _ := brokertest.StreamContext(t)
	desc := &grpc.StreamDesc{ClientStreams: true, ServerStreams: true}
	s, err := b.Conn(t, path).NewStream(ctx, desc, method)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// end waits for the stream's status.
func end(s grpc.ClientStream) error {
	var m tunnelv1.DialResponse
	for {
		if err := s.RecvMsg(&m); err != nil {
			return err
		}
	}
}

var eventually = testutil.Eventually

// timedStream opens a silent stream of method as path, and waits until its
// timer is set on clk, the timers of the streams before it included: once
// the clock has timers.
func timedStream(t *testing.T, b *brokertest.Server, clk brokertest.Clock, timers int, path, method string) grpc.ClientStream {
	t.Helper()
	s := silentStream(t, b, path, method)
	clk.WaitForTimers(t, timers)
	return s
}

func TestAStreamThatSendsNoFirstMessageEndsWithDeadlineExceeded(t *testing.T) {
	clk := brokertest.NewClock()
	g, b := startBroker(t, Config{Timeout: 5 * time.Second, Clock: clk})
	for _, tc := range []struct {
		path, method, what string
	}{
		{kcpPath, tunnelv1.DialService_Dial_FullMethodName, "no target within 5s"},
		{agentPath, tunnelv1.AgentService_Tunnel_FullMethodName, "no open within 5s"},
		{agentPath, tunnelv1.AgentService_Connect_FullMethodName, "no register within 5s"},
	} {
		s := timedStream(t, b, clk, 1, tc.path, tc.method)
		// After its patience the stream counts; at the timeout it ends.
		clk.Step(g.cfg.Patience)
		eventually(t, "the stream to be counted", func() bool { return g.quota.TotalHeld() == 1 })
		clk.WaitForTimers(t, 1)
		clk.Step(g.cfg.Timeout - g.cfg.Patience)
		testutil.CheckStatus(t, tc.method, end(s), codes.DeadlineExceeded, tc.what)
		eventually(t, "nothing to be counted", func() bool { return g.quota.TotalHeld() == 0 })
	}
}

func TestAStreamThatSentItsFirstMessageIsNotEndedByTheDeadline(t *testing.T) {
	clk := brokertest.NewClock()
	g, b := startBroker(t, Config{Timeout: 5 * time.Second, Clock: clk})
	ctx, _ := brokertest.StreamContext(t)
	control, err := tunnelv1.NewAgentServiceClient(b.Conn(t, agentPath)).Connect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	reg := &tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Register{Register: &tunnelv1.Register{Clusters: []string{"root"}}}}
	if err := control.Send(reg); err != nil {
		t.Fatal(err)
	}
	if msg, err := control.Recv(); err != nil || msg.GetRegistered() == nil {
		t.Fatalf("registering: %v %v", msg, err)
	}
	// The registration stopped its timer.
	if n := clk.Waiters(); n != 0 {
		t.Errorf("%d timers wait on the clock after the first message, want none", n)
	}
	clk.Step(2 * g.cfg.Timeout)
	// Past the deadline, the registration is still in force: a dial of
	// root reaches the agent.
	b.StartDial(t, kcpPath, brokertest.Target("root"))
	if msg, err := control.Recv(); err != nil || msg.GetDialOrder() == nil {
		t.Fatalf("after the deadline the agent got %v %v, want a dial order", msg, err)
	}
}

func TestStreamsWaitingForTheirFirstMessageAreLimitedPerPeer(t *testing.T) {
	clk := brokertest.NewClock()
	g, b := startBroker(t, Config{Timeout: testutil.WaitLong, MaxPerPeer: 2, Clock: clk})
	dial := tunnelv1.DialService_Dial_FullMethodName
	timedStream(t, b, clk, 1, kcpPath, dial)
	timedStream(t, b, clk, 2, kcpPath, dial)
	clk.Step(g.cfg.Patience)
	eventually(t, "two streams to be counted", func() bool { return g.quota.Held(brokertest.ID(kcpPath)) == 2 })
	third := timedStream(t, b, clk, 3, kcpPath, dial)
	clk.Step(g.cfg.Patience)
	testutil.CheckStatus(t, "a third stream", end(third), codes.ResourceExhausted, "2 streams open that have not sent their first message")
	// Another peer is not held back by this one.
	timedStream(t, b, clk, 3, shardPath, dial)
	clk.Step(g.cfg.Patience)
	eventually(t, "the other peer's stream to be counted", func() bool { return g.quota.Held(brokertest.ID(shardPath)) == 1 })
}

func TestStreamsWaitingForTheirFirstMessageAreLimitedInTotal(t *testing.T) {
	clk := brokertest.NewClock()
	g, b := startBroker(t, Config{Timeout: testutil.WaitLong, MaxTotal: 2, Clock: clk})
	timedStream(t, b, clk, 1, kcpPath, tunnelv1.DialService_Dial_FullMethodName)
	timedStream(t, b, clk, 2, agentPath, tunnelv1.AgentService_Tunnel_FullMethodName)
	clk.Step(g.cfg.Patience)
	eventually(t, "two streams to be counted", func() bool { return g.quota.TotalHeld() == 2 })
	third := timedStream(t, b, clk, 3, shardPath, tunnelv1.DialService_Dial_FullMethodName)
	clk.Step(g.cfg.Patience)
	testutil.CheckStatus(t, "a third stream", end(third), codes.ResourceExhausted, "the broker has 2 streams open that have not sent their first message")
}

func TestAStreamEndedByItsPeerStopsCounting(t *testing.T) {
	clk := brokertest.NewClock()
	g, b := startBroker(t, Config{Timeout: testutil.WaitLong, MaxPerPeer: 1, Clock: clk})
	ctx, cancel := context.WithCancel(t.Context())
	desc := &grpc.StreamDesc{ClientStreams: true, ServerStreams: true}
	if _, err := b.Conn(t, kcpPath).NewStream(ctx, desc, tunnelv1.DialService_Dial_FullMethodName); err != nil {
		t.Fatal(err)
	}
	clk.WaitForTimers(t, 1)
	clk.Step(g.cfg.Patience)
	eventually(t, "the stream to be counted", func() bool { return g.quota.Held(brokertest.ID(kcpPath)) == 1 })
	cancel()
	eventually(t, "the cancelled stream to stop counting", func() bool { return g.quota.Held(brokertest.ID(kcpPath)) == 0 })
}

func TestAUnaryCallCountsUntilItsRequestArrives(t *testing.T) {
	g, b := startBroker(t, Config{Timeout: testutil.WaitLong, MaxPerPeer: 1})
	client := healthpb.NewHealthClient(b.Conn(t, kcpPath))
	for range 3 {
		if _, err := client.Check(t.Context(), &healthpb.HealthCheckRequest{}); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, "the calls to stop counting", func() bool { return g.quota.TotalHeld() == 0 })
}

func TestABurstOfStreamsWhoseFirstMessagesComeWithThemIsNotRefused(t *testing.T) {
	// Room for two streams waiting, and a clock that does not move: while
	// no stream has waited its patience, a burst of dials that send their
	// targets at once must all be heard, however many headers gRPC reads
	// before their messages. (Counting streams from their start refuses
	// hundreds of this burst.)
	_, b := startBroker(t, Config{Timeout: testutil.WaitLong, Patience: DefaultPatience, MaxPerPeer: 2, MaxTotal: 2, Clock: brokertest.NewClock()})
	const burst = 2000
	client := tunnelv1.NewDialServiceClient(b.Conn(t, kcpPath))
	ctx, _ := brokertest.StreamContext(t)
	errs := make(chan error, burst)
	for range burst {
		go func() {
			stream, err := client.Dial(ctx)
			if err == nil {
				err = stream.Send(&tunnelv1.DialRequest{Frame: &tunnelv1.DialRequest_Target{Target: brokertest.Target("nowhere")}})
			}
			if err == nil {
				_, err = stream.Recv()
			}
			errs <- err
		}()
	}
	for range burst {
		// No agent serves the cluster: every dial that was heard says so.
		testutil.CheckStatus(t, "a dial of the burst", <-errs, codes.Unavailable, "no agent serves")
	}
}
