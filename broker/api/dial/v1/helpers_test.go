package dial

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/kcp-dev/tunnel-broker/broker/api/agent/v1"
	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/broker/registry"
	"github.com/kcp-dev/tunnel-broker/internal/devca"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// This file holds the broker the tests dial through: a real gRPC server on
// loopback with SPIFFE mTLS from a throwaway CA, serving the DialService
// under test and the AgentService its tunnels need. The tests play kcp and
// the agent by hand with the generated clients.

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// waitLong bounds every wait for something that should happen. A healthy run
// needs a tiny fraction of it; reaching it means a hang.
const waitLong = 20 * time.Second

const trustDomain = "example.org"

// The identities the tests use, as paths in trustDomain.
const (
	brokerPath = "/broker"
	kcpPath    = "/kcp"   // may dial any cluster
	shardPath  = "/shard" // may dial team-a only
	agentPath  = "/agent" // may serve any cluster
)

func spiffeID(path string) spiffeid.ID {
	return spiffeid.RequireFromPath(spiffeid.RequireTrustDomainFromString(trustDomain), path)
}

func testPolicy(t *testing.T) *policy.Policy {
	t.Helper()
	p, err := policy.New(policy.File{
		Agents: []policy.AgentRule{{ID: spiffeID(agentPath).String(), Clusters: []string{"*"}}},
		Callers: []policy.CallerRule{
			{ID: spiffeID(kcpPath).String()},
			{ID: spiffeID(shardPath).String(), Clusters: []string{"team-a"}},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// svidSource is an SVID and its trust domain's bundle, held in memory.
type svidSource struct {
	svid   *x509svid.SVID
	bundle *x509bundle.Bundle
}

func (s svidSource) GetX509SVID() (*x509svid.SVID, error) { return s.svid, nil }

func (s svidSource) GetX509BundleForTrustDomain(td spiffeid.TrustDomain) (*x509bundle.Bundle, error) {
	return s.bundle.GetX509BundleForTrustDomain(td)
}

func newSource(t *testing.T, ca *devca.CA, path string) svidSource {
	t.Helper()
	issued, err := ca.Issue(devca.Leaf{SPIFFEID: path})
	if err != nil {
		t.Fatal(err)
	}
	svid, err := x509svid.Parse(issued.CertPEM, issued.KeyPEM)
	if err != nil {
		t.Fatal(err)
	}
	bundle, err := x509bundle.Parse(spiffeid.RequireTrustDomainFromString(trustDomain), ca.BundlePEM())
	if err != nil {
		t.Fatal(err)
	}
	return svidSource{svid: svid, bundle: bundle}
}

// config is what a test changes in the broker.
type config struct {
	timeout             time.Duration
	idleTimeout         time.Duration
	maxTunnelsPerCaller int64
}

// broker is one broker under test and the clients that talk to it.
type broker struct {
	t        *testing.T
	ca       *devca.CA
	addr     string
	registry *registry.Registry
	dial     *Service

	draining, stopping  chan struct{}
	drainOnce, stopOnce sync.Once

	mu    sync.Mutex
	conns map[string]*grpc.ClientConn
}

func startBroker(t *testing.T, cfg config) *broker {
	t.Helper()
	ca, err := devca.New("test", trustDomain)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.timeout == 0 {
		cfg.timeout = waitLong
	}
	b := &broker{
		t: t, ca: ca,
		registry: registry.New(),
		draining: make(chan struct{}),
		stopping: make(chan struct{}),
		conns:    map[string]*grpc.ClientConn{},
	}
	pol := testPolicy(t)
	log := slog.New(slog.DiscardHandler)
	srv := grpc.NewServer(
		grpc.Creds(identity.ServerCredentials(newSource(t, ca, brokerPath), tlsconfig.AuthorizeAny())),
		tunnelv1.FrameServerOption(),
		// Stop returns once every handler has: nothing outlives the test.
		grpc.WaitForHandlers(true),
	)
	b.dial = &Service{
		Registry: b.registry, Policy: pol, Timeout: cfg.timeout,
		IdleTimeout: cfg.idleTimeout, MaxTunnelsPerCaller: cfg.maxTunnelsPerCaller,
		Draining: b.draining, Stopping: b.stopping, Log: log,
	}
	b.dial.Register(srv)
	(&agentv1.Service{
		Registry: b.registry, Policy: pol, BrokerID: "test-broker",
		Draining: b.draining, Stopping: b.stopping, Grace: time.Second,
		ProbeEvery: time.Hour, // no probes in these tests
		Log:        log,
	}).Register(srv)

	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	b.addr = lis.Addr().String()
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv.Serve(lis)
	}()
	t.Cleanup(func() {
		srv.Stop()
		<-served
	})
	return b
}

func (b *broker) drain() { b.drainOnce.Do(func() { close(b.draining) }) }
func (b *broker) stop()  { b.stopOnce.Do(func() { close(b.stopping) }) }

// conn is a client connection to the broker as the identity path. It lasts
// as long as the broker.
func (b *broker) conn(t *testing.T, path string) *grpc.ClientConn {
	t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	if cc, ok := b.conns[path]; ok {
		return cc
	}
	creds := identity.ClientCredentials(newSource(t, b.ca, path), tlsconfig.AuthorizeID(spiffeID(brokerPath)))
	cc, err := grpc.NewClient("passthrough:///"+b.addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		t.Fatal(err)
	}
	b.t.Cleanup(func() { _ = cc.Close() })
	b.conns[path] = cc
	return cc
}

// streamContext bounds a client stream: a test that waits on a stream for
// something that never comes fails instead of hanging.
func streamContext(t *testing.T) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithTimeout(t.Context(), waitLong)
	t.Cleanup(cancel)
	return ctx, cancel
}

// startDial opens a Dial stream as caller and sends target.
func (b *broker) startDial(t *testing.T, caller string, target *tunnelv1.Target) (tunnelv1.DialService_DialClient, context.CancelFunc) {
	t.Helper()
	ctx, cancel := streamContext(t)
	stream, err := tunnelv1.NewDialServiceClient(b.conn(t, caller)).Dial(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&tunnelv1.DialRequest{Frame: &tunnelv1.DialRequest_Target{Target: target}}); err != nil {
		t.Fatal(err)
	}
	return stream, cancel
}

// dialStatus dials target as caller and returns the status the dial ends with.
func (b *broker) dialStatus(t *testing.T, caller string, target *tunnelv1.Target) error {
	t.Helper()
	stream, _ := b.startDial(t, caller, target)
	msg, err := stream.Recv()
	if err == nil {
		t.Fatalf("dial of %v answered %v, want an error", target, msg)
	}
	return err
}

func target(cluster string) *tunnelv1.Target {
	return &tunnelv1.Target{Cluster: cluster, Namespace: "default", Service: "webhook", Port: 443}
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
	ctx, _ := streamContext(t)
	control, err := tunnelv1.NewAgentServiceClient(b.conn(t, agentPath)).Connect(ctx)
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
	ctx, cancel := streamContext(t)
	tun, err := tunnelv1.NewAgentServiceClient(a.b.conn(t, agentPath)).Tunnel(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := tun.Send(&tunnelv1.TunnelRequest{Frame: &tunnelv1.TunnelRequest_Open{Open: &tunnelv1.TunnelOpen{DialId: dialID}}}); err != nil {
		t.Fatal(err)
	}
	return tun, cancel
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
	stream, cancelCaller := a.b.startDial(t, caller, tg)
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

// checkStatus checks err's code and that its message contains message.
func checkStatus(t *testing.T, what string, err error, code codes.Code, message string) {
	t.Helper()
	st := status.Convert(err)
	if err == nil || st.Code() != code || !strings.Contains(st.Message(), message) {
		t.Errorf("%s: got %v, want %v with a message containing %q", what, err, code, message)
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
