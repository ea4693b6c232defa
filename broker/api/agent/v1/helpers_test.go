package agent

import (
	"context"
	"errors"
	"github.com/kcp-dev/tunnel-broker/broker/admission"
	"io"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
	"k8s.io/utils/clock"

	dialv1 "github.com/kcp-dev/tunnel-broker/broker/api/dial/v1"
	"github.com/kcp-dev/tunnel-broker/broker/internal/brokertest"
	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/broker/registry"
	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// This file holds the broker the tests connect to: brokertest's real gRPC
// server on loopback with SPIFFE mTLS from a throwaway CA, serving the
// AgentService under test and the DialService that makes its dials. The tests
// play the agent and kcp by hand with the generated clients.

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// The identities the tests use, as paths in brokertest.TrustDomain.
const (
	kcpPath = "/kcp"     // may dial any cluster
	agentA  = "/agent-a" // may serve root and team-a
	agentB  = "/agent-b" // may serve root
)

var testPolicy = policy.File{
	Agents: []policy.AgentRule{
		{ID: brokertest.ID(agentA).String(), Clusters: []string{"root", "team-a"}},
		{ID: brokertest.ID(agentB).String(), Clusters: []string{"root"}},
	},
	Callers: []policy.CallerRule{{ID: brokertest.ID(kcpPath).String()}},
}

// config is what a test changes in the broker.
type config struct {
	probeEvery  time.Duration // default: an hour, so no probes
	dialTimeout time.Duration // default: testutil.WaitLong
	grace       time.Duration
	// registerTimeout bounds the first registration; default WaitLong.
	registerTimeout  time.Duration
	maxRegistrations int64
	maxClusters      int
	// clock times probes, the first registration and SVIDs' expiry; nil:
	// the real clock.
	clock clock.WithTickerAndDelayedExecution
	// replicas counts the replicas for agents; nil: no count.
	replicas         *fakeCount
	maxConnectionAge time.Duration
}

const brokerID = "test-broker"

// broker is one broker under test, serving the AgentService under test and
// the DialService that makes its dials.
type broker struct {
	*brokertest.Server
	agents *Service
}

func startBroker(t *testing.T, cfg config) *broker {
	t.Helper()
	if cfg.probeEvery == 0 {
		cfg.probeEvery = time.Hour
	}
	if cfg.dialTimeout == 0 {
		cfg.dialTimeout = testutil.WaitLong
	}
	if cfg.registerTimeout == 0 {
		cfg.registerTimeout = testutil.WaitLong
	}
	b := &broker{}
	b.Server = brokertest.Start(t, testPolicy, func(s *brokertest.Server, srv *grpc.Server) {
		b.agents = New(Config{
			Registry: s.Registry, Policy: s.Policy, BrokerID: brokerID,
			Draining: s.Draining, Stopping: s.Stopping, Grace: cfg.grace,
			ProbeEvery: cfg.probeEvery, RegistrationTimeout: cfg.registerTimeout,
			MaxRegistrations: cfg.maxRegistrations, MaxClusters: cfg.maxClusters,
			MaxConnectionAge: cfg.maxConnectionAge,
			Clock:            cfg.clock, Log: s.Log,
		})
		if cfg.replicas != nil {
			b.agents.cfg.Replicas = cfg.replicas
		}
		RegisterService(srv, b.agents)
		dialv1.RegisterService(srv, dialv1.New(dialv1.Config{Admission: admission.New(admission.Config{
			Registry: s.Registry, Policy: s.Policy, Timeout: cfg.dialTimeout,
			Tunnels: tunnel.Config{Stopping: s.Stopping}, Draining: s.Draining, Log: s.Log,
		})}))
	})
	return b
}

func register(clusters ...string) *tunnelv1.ConnectRequest {
	return &tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Register{Register: &tunnelv1.Register{Clusters: clusters}}}
}

// registerMore is a register that more follow.
func registerMore(clusters ...string) *tunnelv1.ConnectRequest {
	r := register(clusters...)
	r.GetRegister().More = true
	return r
}

// series is the value of the per-agent metric name for the agent named
// agent with the SPIFFE ID of path, and whether the series exists.
func series(t *testing.T, name, agent, path string) (float64, bool) {
	t.Helper()
	return brokertest.Metric(t, name, func(labels map[string]string) bool {
		return labels["agent"] == agent && labels["spiffe_id"] == brokertest.ID(path).String()
	})
}

// connectStatus opens a control stream as path, sends msgs and returns the
// status the stream ends with; any answer before it fails the test.
func (b *broker) connectStatus(t *testing.T, path string, msgs ...*tunnelv1.ConnectRequest) error {
	t.Helper()
	ctx, _ := brokertest.StreamContext(t)
	control, err := tunnelv1.NewAgentServiceClient(b.Conn(t, path)).Connect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// The broker may refuse the stream before it reads a message: Send
	// then reports io.EOF, and Recv the status.
	for _, m := range msgs {
		if err := control.Send(m); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatal(err)
		}
	}
	if err := control.CloseSend(); err != nil {
		t.Fatal(err)
	}
	msg, err := control.Recv()
	if err == nil {
		t.Fatalf("broker answered %v, want the stream to end", msg)
	}
	return err
}

// agent plays an agent by hand: it registers, and a goroutine reads its
// control stream into msgs until the stream ends with err.
type agent struct {
	name       string
	registered *tunnelv1.Registered
	control    tunnelv1.AgentService_ConnectClient
	cancel     context.CancelFunc
	msgs       chan *tunnelv1.ConnectResponse
	done       chan struct{}
	err        error // the stream's end, once done is closed
}

// connectAgent registers name, as the identity path, for clusters and checks
// the broker's answer. The control stream lasts as long as the test t.
func (b *broker) connectAgent(t *testing.T, path, name string, clusters ...string) *agent {
	t.Helper()
	ctx, cancel := brokertest.StreamContext(t)
	control, err := tunnelv1.NewAgentServiceClient(b.Conn(t, path)).Connect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	reg := register(clusters...)
	reg.GetRegister().AgentName = name
	if err := control.Send(reg); err != nil {
		t.Fatal(err)
	}
	msg, err := control.Recv()
	if err != nil {
		t.Fatalf("registering %s: %v", name, err)
	}
	if r := msg.GetRegistered(); r == nil || r.GetBrokerId() != brokerID || r.GetSince() == nil {
		t.Fatalf("registering %s: got %v, want registered by %s with a time", name, msg, brokerID)
	}
	a := &agent{name: name, registered: msg.GetRegistered(), control: control, cancel: cancel,
		msgs: make(chan *tunnelv1.ConnectResponse, 64), done: make(chan struct{})}
	go func() {
		defer close(a.done)
		for {
			msg, err := control.Recv()
			if err != nil {
				a.err = err
				return
			}
			select {
			case a.msgs <- msg:
			case <-ctx.Done():
				a.err = ctx.Err()
				return
			}
		}
	}()
	return a
}

// next is the next message the broker sends the agent.
func (a *agent) next(t *testing.T) *tunnelv1.ConnectResponse {
	t.Helper()
	select {
	case msg := <-a.msgs:
		return msg
	case <-a.done:
		// The reader queues each message before it ends.
		select {
		case msg := <-a.msgs:
			return msg
		default:
		}
		t.Fatalf("%s: control stream ended: %v", a.name, a.err)
	case <-time.After(testutil.WaitLong):
		t.Fatalf("%s: no message from the broker", a.name)
	}
	return nil
}

// order is the next message, which must be a dial order for want.
func (a *agent) order(t *testing.T, want *tunnelv1.Target) *tunnelv1.DialOrder {
	t.Helper()
	msg := a.next(t)
	order := msg.GetDialOrder()
	if order == nil || !proto.Equal(order.GetTarget(), want) {
		t.Fatalf("%s got %v, want a dial order for %v", a.name, msg, want)
	}
	return order
}

func (a *agent) send(t *testing.T, msg *tunnelv1.ConnectRequest) {
	t.Helper()
	if err := a.control.Send(msg); err != nil {
		t.Fatalf("%s: %v", a.name, err)
	}
}

// fail reports a dial failure on the control stream.
func (a *agent) fail(t *testing.T, dialID uint64, code codes.Code, message string) {
	t.Helper()
	a.send(t, &tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_DialFailure{DialFailure: &tunnelv1.DialFailure{
		DialId: dialID, Code: int32(code), Message: message}}})
}

// end waits for the control stream to end and returns its status, nil for
// OK. Messages not read yet are dropped.
func (a *agent) end(t *testing.T) error {
	t.Helper()
	select {
	case <-a.done:
	case <-time.After(testutil.WaitLong):
		t.Fatalf("%s: control stream did not end", a.name)
	}
	if errors.Is(a.err, io.EOF) {
		return nil
	}
	return a.err
}

// open opens a Tunnel stream as path, for dialID.
func (b *broker) open(t *testing.T, path string, dialID uint64) tunnelv1.AgentService_TunnelClient {
	t.Helper()
	tun, _ := b.OpenTunnel(t, path, dialID)
	return tun
}

// tunnelStatus reads a Tunnel stream to its end and returns its status.
func tunnelStatus(t *testing.T, tun tunnelv1.AgentService_TunnelClient) error {
	t.Helper()
	msg, err := tun.Recv()
	if err == nil {
		t.Fatalf("tunnel got %v, want its end", msg)
	}
	if errors.Is(err, io.EOF) {
		return nil
	}
	return err
}

// startDial opens a Dial stream as kcp and sends target.
func (b *broker) startDial(t *testing.T, tg *tunnelv1.Target) tunnelv1.DialService_DialClient {
	t.Helper()
	stream, _ := b.StartDial(t, kcpPath, tg)
	return stream
}

// dialStatus is the status a dial ends with; an answer fails the test.
func dialStatus(t *testing.T, stream tunnelv1.DialService_DialClient) error {
	t.Helper()
	msg, err := stream.Recv()
	if err == nil {
		t.Fatalf("dial answered %v, want an error", msg)
	}
	return err
}

// established checks the dial's first answer is established.
func established(t *testing.T, stream tunnelv1.DialService_DialClient) {
	t.Helper()
	msg, err := stream.Recv()
	if err != nil || msg.GetEstablished() == nil {
		t.Fatalf("dial got %v, %v; want established", msg, err)
	}
}

// registered finds the registry's entry for the agent named name.
func (b *broker) registered(name string) *registry.Agent {
	for _, a := range b.Registry.Agents() {
		if a.Name == name {
			return a
		}
	}
	return nil
}
