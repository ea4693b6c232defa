package opening

import (
	"context"
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
	"github.com/kcp-dev/tunnel-broker/broker/internal/quota"
	"github.com/kcp-dev/tunnel-broker/broker/policy"
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

// startBroker serves the dial and agent services and health behind g.
func startBroker(t *testing.T, g *Guard) *brokertest.Server {
	t.Helper()
	g.Log = slog.New(slog.DiscardHandler)
	if g.Patience == 0 {
		// Count silent streams at once, so that the tests need not wait.
		g.Patience = time.Millisecond
	}
	g.First = map[string]string{
		tunnelv1.DialService_Dial_FullMethodName:     "target",
		tunnelv1.AgentService_Tunnel_FullMethodName:  "open",
		tunnelv1.AgentService_Connect_FullMethodName: "register",
	}
	return brokertest.StartWithOptions(t, testPolicy, g.ServerOptions(), func(s *brokertest.Server, srv *grpc.Server) {
		(&dialv1.Service{
			Registry: s.Registry, Policy: s.Policy, Timeout: brokertest.WaitLong,
			Draining: s.Draining, Stopping: s.Stopping, Log: s.Log,
		}).Register(srv)
		(&agentv1.Service{
			Registry: s.Registry, Policy: s.Policy, BrokerID: "test-broker",
			Draining: s.Draining, Stopping: s.Stopping, ProbeEvery: time.Hour, Log: s.Log,
		}).Register(srv)
		healthpb.RegisterHealthServer(srv, health.NewServer())
		g.Methods(srv)
	})
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

var eventually = brokertest.Eventually

func TestAStreamThatSendsNoFirstMessageEndsWithDeadlineExceeded(t *testing.T) {
	g := &Guard{Timeout: 200 * time.Millisecond}
	b := startBroker(t, g)
	for _, tc := range []struct {
		path, method, what string
	}{
		{kcpPath, tunnelv1.DialService_Dial_FullMethodName, "no target within 200ms"},
		{agentPath, tunnelv1.AgentService_Tunnel_FullMethodName, "no open within 200ms"},
		{agentPath, tunnelv1.AgentService_Connect_FullMethodName, "no register within 200ms"},
	} {
		err := end(silentStream(t, b, tc.path, tc.method))
		brokertest.CheckStatus(t, tc.method, err, codes.DeadlineExceeded, tc.what)
	}
	eventually(t, "nothing to be counted", func() bool { return g.Quota.TotalHeld() == 0 })
}

func TestAStreamThatSentItsFirstMessageIsNotEndedByTheDeadline(t *testing.T) {
	g := &Guard{Timeout: 100 * time.Millisecond}
	b := startBroker(t, g)
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
	eventually(t, "the registration to stop counting", func() bool { return g.Quota.TotalHeld() == 0 })
	// Well past the deadline, the registration is still in force: a dial
	// of root reaches the agent.
	time.Sleep(300 * time.Millisecond)
	stream, _ := b.StartDial(t, kcpPath, brokertest.Target("root"))
	if msg, err := control.Recv(); err != nil || msg.GetDialOrder() == nil {
		t.Fatalf("after the deadline the agent got %v %v, want a dial order", msg, err)
	}
	_ = stream
}

func TestStreamsWaitingForTheirFirstMessageAreLimitedPerPeer(t *testing.T) {
	g := &Guard{Timeout: brokertest.WaitLong, Quota: quota.Quota{PerID: 2}}
	b := startBroker(t, g)
	for range 2 {
		silentStream(t, b, kcpPath, tunnelv1.DialService_Dial_FullMethodName)
	}
	eventually(t, "two streams to be counted", func() bool { return g.Quota.Held(brokertest.ID(kcpPath)) == 2 })
	err := end(silentStream(t, b, kcpPath, tunnelv1.DialService_Dial_FullMethodName))
	brokertest.CheckStatus(t, "a third stream", err, codes.ResourceExhausted, "2 streams open that have not sent their first message")
	// Another peer is not held back by this one.
	other := silentStream(t, b, shardPath, tunnelv1.DialService_Dial_FullMethodName)
	eventually(t, "the other peer's stream to be counted", func() bool { return g.Quota.Held(brokertest.ID(shardPath)) == 1 })
	_ = other
}

func TestStreamsWaitingForTheirFirstMessageAreLimitedInTotal(t *testing.T) {
	g := &Guard{Timeout: brokertest.WaitLong, Quota: quota.Quota{Total: 2}}
	b := startBroker(t, g)
	silentStream(t, b, kcpPath, tunnelv1.DialService_Dial_FullMethodName)
	silentStream(t, b, agentPath, tunnelv1.AgentService_Tunnel_FullMethodName)
	eventually(t, "two streams to be counted", func() bool { return g.Quota.TotalHeld() == 2 })
	err := end(silentStream(t, b, shardPath, tunnelv1.DialService_Dial_FullMethodName))
	brokertest.CheckStatus(t, "a third stream", err, codes.ResourceExhausted, "the broker has 2 streams open that have not sent their first message")
}

func TestAStreamEndedByItsPeerStopsCounting(t *testing.T) {
	g := &Guard{Timeout: brokertest.WaitLong, Quota: quota.Quota{PerID: 1}}
	b := startBroker(t, g)
	ctx, cancel := context.WithCancel(t.Context())
	desc := &grpc.StreamDesc{ClientStreams: true, ServerStreams: true}
	if _, err := b.Conn(t, kcpPath).NewStream(ctx, desc, tunnelv1.DialService_Dial_FullMethodName); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the stream to be counted", func() bool { return g.Quota.Held(brokertest.ID(kcpPath)) == 1 })
	cancel()
	eventually(t, "the cancelled stream to stop counting", func() bool { return g.Quota.Held(brokertest.ID(kcpPath)) == 0 })
}

func TestAUnaryCallCountsUntilItsRequestArrives(t *testing.T) {
	g := &Guard{Timeout: brokertest.WaitLong, Quota: quota.Quota{PerID: 1}}
	b := startBroker(t, g)
	client := healthpb.NewHealthClient(b.Conn(t, kcpPath))
	for range 3 {
		if _, err := client.Check(t.Context(), &healthpb.HealthCheckRequest{}); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, "the calls to stop counting", func() bool { return g.Quota.TotalHeld() == 0 })
}

func TestABurstOfStreamsWhoseFirstMessagesComeWithThemIsNotRefused(t *testing.T) {
	// The default patience, and room for two streams waiting: a burst of
	// dials that send their targets at once must all be heard, however
	// many headers gRPC reads before their messages.
	g := &Guard{Timeout: brokertest.WaitLong, Patience: DefaultPatience, Quota: quota.Quota{PerID: 2, Total: 2}}
	b := startBroker(t, g)
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
		brokertest.CheckStatus(t, "a dial of the burst", <-errs, codes.Unavailable, "no agent serves")
	}
}
