package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kcp-dev/tunnel-broker/internal/coalesce"
	"github.com/kcp-dev/tunnel-broker/internal/devca"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
)

// This file holds the fake broker replica the agents under test register
// with, and small helpers. The fake is a real gRPC server on loopback with
// SPIFFE mTLS from a throwaway CA; it hands each Connect and Tunnel stream
// to the test, which plays the broker's side of the protocol.

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// waitLong bounds every "this eventually happens" in the tests. It is far
// above anything a healthy run needs, so hitting it means a hang.
const waitLong = 20 * time.Second

// The target the tests dial unless they test the target itself.
const (
	testCluster   = "root"
	testNamespace = "default"
	testService   = "webhook"
	testPort      = 443
)

func testTarget() *tunnelv1.Target {
	return &tunnelv1.Target{Cluster: testCluster, Namespace: testNamespace, Service: testService, Port: testPort}
}

// pki is one trust domain with an SVID for the broker and one for the agent.
type pki struct {
	ca            *devca.CA
	broker, agent *devca.Source
	agentID       spiffeid.ID
}

const trustDomain = "example.org"

func newPKI(t *testing.T) *pki {
	t.Helper()
	ca, err := devca.New("test CA", trustDomain)
	if err != nil {
		t.Fatal(err)
	}
	source := func(path string) *devca.Source {
		src, err := ca.Source(devca.Leaf{SPIFFEID: path})
		if err != nil {
			t.Fatal(err)
		}
		return src
	}
	return &pki{
		ca:      ca,
		broker:  source("/broker"),
		agent:   source("/agent"),
		agentID: spiffeid.RequireFromString("spiffe://" + trustDomain + "/agent"),
	}
}

// agentCredentials are what the agent binary uses: mTLS to exactly the
// broker's SPIFFE ID.
func (p *pki) agentCredentials() credentials.TransportCredentials {
	return identity.ClientCredentials(p.agent, tlsconfig.AuthorizeID(spiffeid.RequireFromString("spiffe://"+trustDomain+"/broker")))
}

// fakeBroker is one broker replica.
type fakeBroker struct {
	tunnelv1.UnimplementedAgentServiceServer
	addr string
	id   string // the broker_id it sends in Registered
	// sessions receives each registered Connect stream, tunnels each
	// opened Tunnel stream.
	sessions chan *session
	tunnels  chan *tunnel
	// refusals, when it holds an error, ends the next Connect with it
	// instead of registered.
	refusals chan error
	// keepsClosedStreams, if set, makes the broker keep a Connect stream
	// open after the agent closed its send direction, instead of ending
	// the registration.
	keepsClosedStreams bool
	// maxConnectionAge is sent in Registered; replicas, if not zero, in
	// Replicas right after.
	maxConnectionAge time.Duration
	replicas         int
	readers          sync.WaitGroup
	srv              *grpc.Server
}

// startBroker serves a fake broker on a loopback port until the test ends.
func startBroker(t *testing.T, p *pki) *fakeBroker {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	b := &fakeBroker{
		addr:     lis.Addr().String(),
		id:       "broker-" + lis.Addr().String(),
		sessions: make(chan *session, 16),
		tunnels:  make(chan *tunnel, 16),
		refusals: make(chan error, 4),
	}
	creds := identity.ServerCredentials(p.broker, tlsconfig.AuthorizeMemberOf(spiffeid.RequireTrustDomainFromString(trustDomain)))
	b.srv = grpc.NewServer(grpc.Creds(coalesce.Writes(creds)),
		// The agent's pings, as the broker permits them: a test that runs
		// long is not cut off with too_many_pings.
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 5 * time.Second, PermitWithoutStream: true}))
	tunnelv1.RegisterAgentServiceServer(b.srv, b)
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = b.srv.Serve(lis)
	}()
	t.Cleanup(func() {
		b.stop()
		<-served
		b.readers.Wait()
	})
	return b
}

// stop closes the broker's port and every connection to it, as a replica
// that vanished.
func (b *fakeBroker) stop() { b.srv.Stop() }

// session is the broker's side of one registered control stream.
type session struct {
	peer     spiffeid.ID
	register *tunnelv1.Register
	stream   tunnelv1.AgentService_ConnectServer
	// msgs carries what the agent sends after its first register; it is
	// closed when the agent's side of the stream ends.
	msgs chan *tunnelv1.ConnectRequest
	end  chan error
	// closedSend closes when the agent closes its send direction.
	closedSend chan struct{}
}

func (b *fakeBroker) Connect(stream tunnelv1.AgentService_ConnectServer) error {
	peer, _ := identity.PeerID(stream.Context())
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	if first.GetRegister() == nil {
		return status.Error(codes.InvalidArgument, "the first message must be register")
	}
	select {
	case err := <-b.refusals:
		return err
	default:
	}
	registered := &tunnelv1.Registered{BrokerId: b.id}
	if b.maxConnectionAge > 0 {
		registered.MaxConnectionAge = durationpb.New(b.maxConnectionAge)
	}
	if err := stream.Send(&tunnelv1.ConnectResponse{Message: &tunnelv1.ConnectResponse_Registered{Registered: registered}}); err != nil {
		return err
	}
	if b.replicas > 0 {
		count := &tunnelv1.ConnectResponse{Message: &tunnelv1.ConnectResponse_Replicas{Replicas: &tunnelv1.Replicas{Count: uint32(b.replicas)}}}
		if err := stream.Send(count); err != nil {
			return err
		}
	}
	s := &session{peer: peer, register: first.GetRegister(), stream: stream,
		msgs: make(chan *tunnelv1.ConnectRequest, 64), end: make(chan error, 1), closedSend: make(chan struct{})}
	ctx := stream.Context()
	b.readers.Add(1)
	go func() {
		defer b.readers.Done()
		defer close(s.msgs)
		for {
			m, err := stream.Recv()
			if errors.Is(err, io.EOF) {
				close(s.closedSend)
			}
			if err != nil {
				return
			}
			select {
			case s.msgs <- m:
			case <-ctx.Done():
				return
			}
		}
	}()
	select {
	case b.sessions <- s:
	case <-ctx.Done():
		return ctx.Err()
	}
	closedSend := s.closedSend
	if b.keepsClosedStreams {
		closedSend = nil
	}
	select {
	case err := <-s.end:
		return err
	case <-closedSend:
		// As the broker does: an agent that closes its send direction
		// has ended its registration cleanly.
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// finish ends the Connect RPC with err's status (nil: OK).
func (s *session) finish(err error) { s.end <- err }

func (s *session) send(t *testing.T, m *tunnelv1.ConnectResponse) {
	t.Helper()
	if err := s.stream.Send(m); err != nil {
		t.Fatalf("sending %T on the control stream: %v", m.GetMessage(), err)
	}
}

func (s *session) order(t *testing.T, o *tunnelv1.DialOrder) {
	t.Helper()
	s.send(t, &tunnelv1.ConnectResponse{Message: &tunnelv1.ConnectResponse_DialOrder{DialOrder: o}})
}

// next returns the agent's next message on the control stream.
func (s *session) next(t *testing.T) *tunnelv1.ConnectRequest {
	t.Helper()
	select {
	case m, ok := <-s.msgs:
		if !ok {
			t.Fatal("the agent ended the control stream, want another message")
		}
		return m
	case <-time.After(waitLong):
		t.Fatal("no message from the agent on the control stream")
	}
	return nil
}

// failure returns the agent's next message, which must be a dial_failure.
func (s *session) failure(t *testing.T) *tunnelv1.DialFailure {
	t.Helper()
	m := s.next(t)
	f := m.GetDialFailure()
	if f == nil {
		t.Fatalf("agent sent %T on the control stream, want a dial_failure", m.GetMessage())
	}
	return f
}

// ended waits until the agent's side of the control stream has ended.
func (s *session) ended(t *testing.T) {
	t.Helper()
	deadline := time.After(waitLong)
	for {
		select {
		case _, ok := <-s.msgs:
			if !ok {
				return
			}
		case <-deadline:
			t.Fatal("the agent did not end its control stream")
		}
	}
}

// tunnel is the broker's side of one Tunnel stream, after its open.
type tunnel struct {
	open   *tunnelv1.TunnelOpen
	stream tunnelv1.AgentService_TunnelServer
	end    chan error
	// A reader receives from the stream, so that the test's reads can
	// give up: received carries each message; readErr is the error that
	// ended the stream, set before readDone closes.
	received chan *tunnelv1.TunnelRequest
	readErr  error
	readDone chan struct{}
}

func (b *fakeBroker) Tunnel(stream tunnelv1.AgentService_TunnelServer) error {
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	if first.GetOpen() == nil {
		return status.Error(codes.InvalidArgument, "the first message must be open")
	}
	tu := &tunnel{open: first.GetOpen(), stream: stream, end: make(chan error, 1),
		received: make(chan *tunnelv1.TunnelRequest), readDone: make(chan struct{})}
	ctx := stream.Context()
	b.readers.Add(1)
	go func() {
		defer b.readers.Done()
		defer close(tu.readDone)
		for {
			m, err := stream.Recv()
			if err != nil {
				tu.readErr = err
				return
			}
			select {
			case tu.received <- m:
			case <-ctx.Done():
				tu.readErr = ctx.Err()
				return
			}
		}
	}()
	select {
	case b.tunnels <- tu:
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case err := <-tu.end:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// finish ends the Tunnel RPC with err's status (nil: OK).
func (tu *tunnel) finish(err error) { tu.end <- err }

// send sends b as one data frame.
func (tu *tunnel) send(b []byte) error {
	return tu.stream.Send(&tunnelv1.TunnelResponse{Frame: &tunnelv1.TunnelResponse_Data{Data: b}})
}

// closeWrite half-closes the broker-to-agent direction.
func (tu *tunnel) closeWrite() error {
	return tu.stream.Send(&tunnelv1.TunnelResponse{Frame: &tunnelv1.TunnelResponse_CloseWrite{CloseWrite: &tunnelv1.CloseWrite{}}})
}

// recv returns the next data frame, io.EOF once the agent half-closed, or an
// error for anything else, including a frame that breaks the protocol.
func (tu *tunnel) recv() ([]byte, error) {
	var msg *tunnelv1.TunnelRequest
	select {
	case msg = <-tu.received:
	case <-tu.readDone:
		return nil, tu.readErr
	case <-time.After(waitLong):
		return nil, errors.New("timed out waiting for the agent to send on the tunnel")
	}
	data := msg.GetData()
	if len(data) == 0 {
		return nil, fmt.Errorf("protocol error: agent sent %T, want non-empty data", msg.GetFrame())
	}
	if len(data) > wire.MaxFrame {
		return nil, fmt.Errorf("agent sent a frame of %d bytes, more than %d", len(data), wire.MaxFrame)
	}
	return data, nil
}

// recvAll returns the bytes the agent sends until it half-closes.
func (tu *tunnel) recvAll() ([]byte, error) {
	var all []byte
	for {
		data, err := tu.recv()
		if errors.Is(err, io.EOF) {
			return all, nil
		}
		if err != nil {
			return all, err
		}
		all = append(all, data...)
	}
}

// recvN returns the next n bytes the agent sends.
func (tu *tunnel) recvN(n int) ([]byte, error) {
	var all []byte
	for len(all) < n {
		data, err := tu.recv()
		if err != nil {
			return all, err
		}
		all = append(all, data...)
	}
	if len(all) > n {
		return all, fmt.Errorf("agent sent %d bytes, want %d", len(all), n)
	}
	return all, nil
}

// nextSession waits for the agent's next registered control stream.
func (b *fakeBroker) nextSession(t *testing.T) *session {
	t.Helper()
	return testutil.Wait(t, "a registration with broker "+b.addr, b.sessions)
}

// nextTunnel waits for the agent's next Tunnel stream.
func (b *fakeBroker) nextTunnel(t *testing.T) *tunnel {
	t.Helper()
	return testutil.Wait(t, "a Tunnel stream", b.tunnels)
}

// noTunnel checks that no Tunnel stream has been opened so far.
func (b *fakeBroker) noTunnel(t *testing.T) {
	t.Helper()
	select {
	case tu := <-b.tunnels:
		t.Errorf("agent opened a Tunnel for dial %d, want none", tu.open.GetDialId())
	default:
	}
}

// newAgent makes an agent of broker b that resolves with r. Its grace is
// short, so that a test that leaves a tunnel open still ends soon.
func newAgent(t *testing.T, p *pki, b *fakeBroker, r lookup.Resolver) *Agent {
	return &Agent{
		Broker:      b.addr,
		Credentials: p.agentCredentials(),
		Name:        "test-agent",
		Resolver:    r,
		Grace:       50 * time.Millisecond,
		Log:         slog.New(slog.NewTextHandler(t.Output(), nil)),
	}
}

// run runs a until the returned stop is called or the test ends. stop
// waits for Run to return.
func run(t *testing.T, a *Agent) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("Run: %v", err)
				}
			case <-time.After(waitLong):
				t.Error("Run did not return after its context ended")
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// fakeClock gives a a fake clock, which only the test moves.
func fakeClock(a *Agent) *clocktesting.FakeClock {
	c := clocktesting.NewFakeClock(time.Now())
	a.Clock = c
	return c
}

// waitUntilWaiting returns once something waits on c: a timer, a ticker.
func waitUntilWaiting(t *testing.T, c *clocktesting.FakeClock, what string) {
	t.Helper()
	deadline := time.Now().Add(waitLong)
	for !c.HasWaiters() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for the agent to wait for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// staticResolver resolves the test target to addr.
func staticResolver(t *testing.T, addr string) *lookup.Static {
	t.Helper()
	r, err := lookup.NewStatic(lookup.StaticFile{Services: []lookup.StaticService{{
		Cluster: testCluster, Namespace: testNamespace, Name: testService,
		Ports: map[string]string{fmt.Sprint(testPort): addr},
	}}})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// funcResolver resolves with a function and records the targets asked for.
type funcResolver struct {
	clusters []string
	resolve  func(ctx context.Context, t *tunnelv1.Target) ([]string, error)

	mu    sync.Mutex
	asked []*tunnelv1.Target
}

func (r *funcResolver) Clusters() []string { return r.clusters }

func (r *funcResolver) Resolve(ctx context.Context, t *tunnelv1.Target) ([]string, error) {
	r.mu.Lock()
	r.asked = append(r.asked, t)
	r.mu.Unlock()
	return r.resolve(ctx, t)
}

func (r *funcResolver) targetsAsked() []*tunnelv1.Target {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]*tunnelv1.Target(nil), r.asked...)
}

// target is a TCP server standing for a webhook pod.
type target struct {
	lis *net.TCPListener
}

func listenTarget(t *testing.T) *target {
	t.Helper()
	lis, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = lis.Close() })
	return &target{lis: lis}
}

func (tg *target) addr() string { return tg.lis.Addr().String() }

// accept returns the next connection the agent made to the target.
func (tg *target) accept(t *testing.T) *net.TCPConn {
	t.Helper()
	if err := tg.lis.SetDeadline(time.Now().Add(waitLong)); err != nil {
		t.Fatal(err)
	}
	c, err := tg.lis.AcceptTCP()
	if err != nil {
		t.Fatalf("the agent did not connect to the target: %v", err)
	}
	t.Cleanup(func() { _ = c.Close() })
	if err := c.SetDeadline(time.Now().Add(waitLong)); err != nil {
		t.Fatal(err)
	}
	return c
}

// noConnection checks that nobody has connected to the target so far. A
// connect the agent made has completed before it opens a Tunnel or reports
// a failure, so it is in the accept queue by then.
func (tg *target) noConnection(t *testing.T) {
	t.Helper()
	if err := tg.lis.SetDeadline(time.Now()); err != nil {
		t.Fatal(err)
	}
	if c, err := tg.lis.Accept(); err == nil {
		c.Close()
		t.Errorf("the agent connected to %s, which its resolver did not return", tg.addr())
	}
}

// capturedLog holds what an agent logs, and shows it in the test's output.
type capturedLog struct {
	mu    sync.Mutex
	lines []string
}

// captureLog makes a log to the test's output and to the returned log.
func captureLog(t *testing.T, a *Agent) *capturedLog {
	c := &capturedLog{}
	a.Log = slog.New(slog.NewTextHandler(io.MultiWriter(t.Output(), c), nil))
	return c
}

func (c *capturedLog) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.lines = append(c.lines, string(p))
	return len(p), nil
}

// line is the first line logged that holds what; the test fails if there
// is none.
func (c *capturedLog) line(t *testing.T, what string) string {
	t.Helper()
	l, ok := c.find(what)
	if !ok {
		t.Fatalf("nothing logged holds %q", what)
	}
	return l
}

// waitLine is line once it is logged.
func (c *capturedLog) waitLine(t *testing.T, what string) string {
	t.Helper()
	testutil.Eventually(t, "a log line with "+what, func() bool { _, ok := c.find(what); return ok })
	return c.line(t, what)
}

func (c *capturedLog) find(what string) (string, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, l := range c.lines {
		if strings.Contains(l, what) {
			return l, true
		}
	}
	return "", false
}

// refusedAddr is a loopback address where nothing listens: its port is
// bound, without listening, until the test ends, so that connections to it
// are refused and no other test or process can take it meanwhile.
func refusedAddr(t *testing.T) string {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	bound, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(bound.(*syscall.SockaddrInet4).Port))
}

// dialOrder is an order for the test target.
func dialOrder(id uint64) *tunnelv1.DialOrder {
	return &tunnelv1.DialOrder{DialId: id, Target: testTarget(), TimeoutMs: uint32(waitLong.Milliseconds())}
}

// established runs an agent of a fresh broker that resolves the test target
// to a fresh target server, orders dial id 1, and returns the tunnel's three
// ends.
func established(t *testing.T) (*session, *tunnel, *net.TCPConn) {
	t.Helper()
	return establishedBy(t, dialOrder(1))
}

// establishedBy is established with order, which must be for dial id 1.
func establishedBy(t *testing.T, order *tunnelv1.DialOrder) (*session, *tunnel, *net.TCPConn) {
	t.Helper()
	p := newPKI(t)
	b := startBroker(t, p)
	tg := listenTarget(t)
	run(t, newAgent(t, p, b, staticResolver(t, tg.addr())))
	s := b.nextSession(t)
	s.order(t, order)
	conn := tg.accept(t)
	tu := b.nextTunnel(t)
	if got := tu.open.GetDialId(); got != 1 {
		t.Fatalf("Tunnel opened for dial %d, want 1", got)
	}
	return s, tu, conn
}
