package agent

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

	dialv1 "github.com/kcp-dev/tunnel-broker/broker/api/dial/v1"
	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/broker/registry"
	"github.com/kcp-dev/tunnel-broker/internal/devca"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// This file holds the broker the tests connect to: a real gRPC server on
// loopback with SPIFFE mTLS from a throwaway CA, serving the AgentService
// under test and the DialService that makes its dials. The tests play the
// agent and kcp by hand with the generated clients.

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
	kcpPath    = "/kcp"     // may dial any cluster
	agentA     = "/agent-a" // may serve root and team-a
	agentB     = "/agent-b" // may serve root
)

func spiffeID(path string) spiffeid.ID {
	return spiffeid.RequireFromPath(spiffeid.RequireTrustDomainFromString(trustDomain), path)
}

func testPolicy(t *testing.T) *policy.Policy {
	t.Helper()
	p, err := policy.New(policy.File{
		Agents: []policy.AgentRule{
			{ID: spiffeID(agentA).String(), Clusters: []string{"root", "team-a"}},
			{ID: spiffeID(agentB).String(), Clusters: []string{"root"}},
		},
		Callers: []policy.CallerRule{{ID: spiffeID(kcpPath).String()}},
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
	probeEvery  time.Duration // default: an hour, so no probes
	dialTimeout time.Duration // default: waitLong
	grace       time.Duration
}

const brokerID = "test-broker"

// broker is one broker under test and the clients that talk to it.
type broker struct {
	t        *testing.T
	ca       *devca.CA
	addr     string
	registry *registry.Registry

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
	if cfg.probeEvery == 0 {
		cfg.probeEvery = time.Hour
	}
	if cfg.dialTimeout == 0 {
		cfg.dialTimeout = waitLong
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
	(&Service{
		Registry: b.registry, Policy: pol, BrokerID: brokerID,
		Draining: b.draining, Stopping: b.stopping, Grace: cfg.grace,
		ProbeEvery: cfg.probeEvery, Log: log,
	}).Register(srv)
	(&dialv1.Service{
		Registry: b.registry, Policy: pol, Timeout: cfg.dialTimeout,
		Draining: b.draining, Stopping: b.stopping, Log: log,
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

func register(clusters ...string) *tunnelv1.ConnectRequest {
	return &tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Register{Register: &tunnelv1.Register{Clusters: clusters}}}
}

// connectStatus opens a control stream as path, sends msgs and returns the
// status the stream ends with; any answer before it fails the test.
func (b *broker) connectStatus(t *testing.T, path string, msgs ...*tunnelv1.ConnectRequest) error {
	t.Helper()
	ctx, _ := streamContext(t)
	control, err := tunnelv1.NewAgentServiceClient(b.conn(t, path)).Connect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range msgs {
		if err := control.Send(m); err != nil {
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
	name    string
	control tunnelv1.AgentService_ConnectClient
	cancel  context.CancelFunc
	msgs    chan *tunnelv1.ConnectResponse
	done    chan struct{}
	err     error // the stream's end, once done is closed
}

// connectAgent registers name, as the identity path, for clusters and checks
// the broker's answer. The control stream lasts as long as the test t.
func (b *broker) connectAgent(t *testing.T, path, name string, clusters ...string) *agent {
	t.Helper()
	ctx, cancel := streamContext(t)
	control, err := tunnelv1.NewAgentServiceClient(b.conn(t, path)).Connect(ctx)
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
	a := &agent{name: name, control: control, cancel: cancel,
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
	case <-time.After(waitLong):
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
	case <-time.After(waitLong):
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
	ctx, _ := streamContext(t)
	tun, err := tunnelv1.NewAgentServiceClient(b.conn(t, path)).Tunnel(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := tun.Send(&tunnelv1.TunnelRequest{Frame: &tunnelv1.TunnelRequest_Open{Open: &tunnelv1.TunnelOpen{DialId: dialID}}}); err != nil {
		t.Fatal(err)
	}
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

func target(cluster string) *tunnelv1.Target {
	return &tunnelv1.Target{Cluster: cluster, Namespace: "default", Service: "webhook", Port: 443}
}

// startDial opens a Dial stream as kcp and sends target.
func (b *broker) startDial(t *testing.T, tg *tunnelv1.Target) tunnelv1.DialService_DialClient {
	t.Helper()
	ctx, _ := streamContext(t)
	stream, err := tunnelv1.NewDialServiceClient(b.conn(t, kcpPath)).Dial(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&tunnelv1.DialRequest{Frame: &tunnelv1.DialRequest_Target{Target: tg}}); err != nil {
		t.Fatal(err)
	}
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
	for _, a := range b.registry.Agents() {
		if a.Name == name {
			return a
		}
	}
	return nil
}

// checkStatus checks err's code and that its message contains message.
func checkStatus(t *testing.T, what string, err error, code codes.Code, message string) {
	t.Helper()
	st := status.Convert(err)
	if err == nil || st.Code() != code || !strings.Contains(st.Message(), message) {
		t.Errorf("%s: got %v, want %v with a message containing %q", what, err, code, message)
	}
}

// eventually polls cond until it holds, failing the test after waitLong.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitLong)
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		<-tick.C
	}
}
