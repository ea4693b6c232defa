package dial

import (
	"context"
	"errors"
	"io"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/kcp-dev/tunnel-broker/broker/api/agent/v1"
	"github.com/kcp-dev/tunnel-broker/broker/internal/brokertest"
	"github.com/kcp-dev/tunnel-broker/broker/policy"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// This file holds the broker the tests dial through: brokertest's real gRPC
// server on loopback with SPIFFE mTLS from a throwaway CA, serving the
// DialService under test and the AgentService its tunnels need. The tests
// play kcp and the agent by hand with the generated clients.

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// The identities the tests use, as paths in brokertest.TrustDomain.
const (
	kcpPath   = "/kcp"   // may dial any cluster
	shardPath = "/shard" // may dial team-a only
	agentPath = "/agent" // may serve any cluster
)

var testPolicy = policy.File{
	Agents: []policy.AgentRule{{ID: brokertest.ID(agentPath).String(), Clusters: []string{"*"}}},
	Callers: []policy.CallerRule{
		{ID: brokertest.ID(kcpPath).String()},
		{ID: brokertest.ID(shardPath).String(), Clusters: []string{"team-a"}},
	},
}

// config is what a test changes in the broker.
type config struct {
	timeout             time.Duration
	idleTimeout         time.Duration
	maxTunnelsPerCaller int64
	// clock times the idle limit; default: the real clock.
	clock *brokertest.Clock
}

// broker is one broker under test, serving the DialService under test and the
// AgentService its tunnels need.
type broker struct {
	*brokertest.Server
	dial *Service
}

func startBroker(t *testing.T, cfg config) *broker {
	t.Helper()
	if cfg.timeout == 0 {
		cfg.timeout = brokertest.WaitLong
	}
	b := &broker{}
	b.Server = brokertest.Start(t, testPolicy, func(s *brokertest.Server, srv *grpc.Server) {
		b.dial = &Service{
			Registry: s.Registry, Policy: s.Policy, Timeout: cfg.timeout,
			IdleTimeout: cfg.idleTimeout, MaxTunnelsPerCaller: cfg.maxTunnelsPerCaller,
			Draining: s.Draining, Stopping: s.Stopping, Log: s.Log,
		}
		if cfg.clock != nil {
			b.dial.Clock = cfg.clock
		}
		b.dial.Register(srv)
		(&agentv1.Service{
			Registry: s.Registry, Policy: s.Policy, BrokerID: "test-broker",
			Draining: s.Draining, Stopping: s.Stopping, Grace: time.Second,
			ProbeEvery: time.Hour, // no probes in these tests
			Log:        s.Log,
		}).Register(srv)
	})
	return b
}

// dialStatus dials target as caller and returns the status the dial ends with.
func (b *broker) dialStatus(t *testing.T, caller string, target *tunnelv1.Target) error {
	t.Helper()
	stream, _ := b.StartDial(t, caller, target)
	msg, err := stream.Recv()
	if err == nil {
		t.Fatalf("dial of %v answered %v, want an error", target, msg)
	}
	return err
}

// agent plays an agent by hand over its control stream.
type agent struct {
	b       *broker
	control tunnelv1.AgentService_ConnectClient
}

// connectAgent registers an agent for clusters and reads its registration.
// Its control stream lasts as long as the test t.
func (b *broker) connectAgent(t *testing.T, name string, clusters ...string) *agent {
	t.Helper()
	ctx, _ := brokertest.StreamContext(t)
	control, err := tunnelv1.NewAgentServiceClient(b.Conn(t, agentPath)).Connect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	reg := &tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Register{Register: &tunnelv1.Register{Clusters: clusters, AgentName: name}}}
	if err := control.Send(reg); err != nil {
		t.Fatal(err)
	}
	msg, err := control.Recv()
	if err != nil || msg.GetRegistered() == nil {
		t.Fatalf("registering: %v, %v", msg, err)
	}
	return &agent{b: b, control: control}
}

// order is the next dial order, which must be for want.
func (a *agent) order(t *testing.T, want *tunnelv1.Target) *tunnelv1.DialOrder {
	t.Helper()
	for {
		msg, err := a.control.Recv()
		if err != nil {
			t.Fatalf("waiting for a dial order: %v", err)
		}
		if msg.GetDrain() != nil {
			continue
		}
		order := msg.GetDialOrder()
		if order == nil {
			t.Fatalf("agent got %v, want a dial order", msg)
		}
		if !proto.Equal(order.GetTarget(), want) {
			t.Fatalf("order for %v, want %v", order.GetTarget(), want)
		}
		return order
	}
}

// open opens the agent's Tunnel for a dial.
func (a *agent) open(t *testing.T, dialID uint64) (tunnelv1.AgentService_TunnelClient, context.CancelFunc) {
	t.Helper()
	return a.b.OpenTunnel(t, agentPath, dialID)
}

// tunnel is one established tunnel: the caller's and the agent's streams.
type tunnel struct {
	t                         *testing.T
	caller                    tunnelv1.DialService_DialClient
	agent                     tunnelv1.AgentService_TunnelClient
	cancelCaller, cancelAgent context.CancelFunc
}

// establish dials target as kcp through a, and checks the broker's answer.
// The tunnel's streams last as long as the test t.
func (a *agent) establish(t *testing.T, tg *tunnelv1.Target) *tunnel {
	t.Helper()
	return a.establishAs(t, kcpPath, tg)
}

func (a *agent) establishAs(t *testing.T, caller string, tg *tunnelv1.Target) *tunnel {
	t.Helper()
	stream, cancelCaller := a.b.StartDial(t, caller, tg)
	order := a.order(t, tg)
	tun, cancelAgent := a.open(t, order.GetDialId())
	msg, err := stream.Recv()
	if err != nil {
		t.Fatalf("waiting for established: %v", err)
	}
	est := msg.GetEstablished()
	if est == nil {
		t.Fatalf("first answer %v, want established", msg)
	}
	return &tunnel{t: t, caller: stream, agent: tun, cancelCaller: cancelCaller, cancelAgent: cancelAgent}
}

func dataUp(b []byte) *tunnelv1.DialRequest {
	return &tunnelv1.DialRequest{Frame: &tunnelv1.DialRequest_Data{Data: b}}
}

func dataDown(b []byte) *tunnelv1.TunnelRequest {
	return &tunnelv1.TunnelRequest{Frame: &tunnelv1.TunnelRequest_Data{Data: b}}
}

// up sends p from the caller and checks the agent receives exactly it.
func (tn *tunnel) up(p string) {
	tn.t.Helper()
	if err := tn.caller.Send(dataUp([]byte(p))); err != nil {
		tn.t.Fatal(err)
	}
	msg, err := tn.agent.Recv()
	if err != nil {
		tn.t.Fatalf("agent waiting for %q: %v", p, err)
	}
	if got := string(msg.GetData()); got != p {
		tn.t.Fatalf("agent got %v, want data %q", msg, p)
	}
}

// down sends p from the agent and checks the caller receives exactly it.
func (tn *tunnel) down(p string) {
	tn.t.Helper()
	if err := tn.agent.Send(dataDown([]byte(p))); err != nil {
		tn.t.Fatal(err)
	}
	msg, err := tn.caller.Recv()
	if err != nil {
		tn.t.Fatalf("caller waiting for %q: %v", p, err)
	}
	if got := string(msg.GetData()); got != p {
		tn.t.Fatalf("caller got %v, want data %q", msg, p)
	}
}

// callerEnd reads the caller's stream to its end and returns its status
// (nil for OK); anything but data on the way fails the test.
func (tn *tunnel) callerEnd() error {
	tn.t.Helper()
	for {
		msg, err := tn.caller.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		if msg.GetData() == nil {
			tn.t.Fatalf("caller got %v before the end", msg)
		}
	}
}

// agentEnd is callerEnd for the agent's Tunnel stream.
func (tn *tunnel) agentEnd() error {
	tn.t.Helper()
	for {
		msg, err := tn.agent.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		if msg.GetData() == nil {
			tn.t.Fatalf("agent got %v before the end", msg)
		}
	}
}

// closeWriteUp half-closes the caller's direction and checks the agent hears it.
func (tn *tunnel) closeWriteUp() {
	tn.t.Helper()
	if err := tn.caller.CloseSend(); err != nil {
		tn.t.Fatal(err)
	}
	msg, err := tn.agent.Recv()
	if err != nil || msg.GetCloseWrite() == nil {
		tn.t.Fatalf("agent got %v, %v; want close_write", msg, err)
	}
}

// closeWriteDown half-closes the agent's direction and checks the caller
// hears it.
func (tn *tunnel) closeWriteDown() {
	tn.t.Helper()
	if err := tn.agent.CloseSend(); err != nil {
		tn.t.Fatal(err)
	}
	msg, err := tn.caller.Recv()
	if err != nil || msg.GetCloseWrite() == nil {
		tn.t.Fatalf("caller got %v, %v; want close_write", msg, err)
	}
}

// closeBoth half-closes both directions and checks both RPCs end with OK.
func (tn *tunnel) closeBoth() {
	tn.t.Helper()
	tn.closeWriteUp()
	tn.closeWriteDown()
	if err := tn.callerEnd(); err != nil {
		tn.t.Errorf("caller's status: %v, want OK", err)
	}
	if err := tn.agentEnd(); err != nil {
		tn.t.Errorf("agent's status: %v, want OK", err)
	}
}
