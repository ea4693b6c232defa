package agent

import (
	"errors"
	"io"
	"log/slog"
	"net"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
)

func TestRegisterCarriesResolverClustersAndAgentName(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	r, err := lookup.NewStatic(lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: "root", Namespace: "default", Name: "webhook", Ports: map[string]string{"443": "127.0.0.1:1"}},
		{Cluster: "1x2y3z4w5v6u7t8s", Namespace: "default", Name: "webhook", Ports: map[string]string{"443": "127.0.0.1:1"}},
	}})
	if err != nil {
		t.Fatal(err)
	}
	a := newAgent(t, p, b, r)
	a.Name = "us-east-1"
	registered := make(chan string, 4)
	a.Registered = func(brokerID string) { registered <- brokerID }
	run(t, a)

	s := b.nextSession(t)
	if got, want := s.register.GetClusters(), r.Clusters(); !slices.Equal(got, want) {
		t.Errorf("register clusters %v, want the resolver's %v", got, want)
	}
	if got := s.register.GetAgentName(); got != "us-east-1" {
		t.Errorf("register agent_name %q, want %q", got, "us-east-1")
	}
	if s.peer != p.agentID {
		t.Errorf("broker saw peer %q, want the agent's SVID %q", s.peer, p.agentID)
	}
	if got := testutil.Wait(t, "the Registered callback", registered); got != b.id {
		t.Errorf("Registered(%q), want the broker's id %q", got, b.id)
	}
	if !a.IsRegistered() {
		t.Error("IsRegistered is false after the broker confirmed the registration")
	}
}

func TestAgentReconnectsAfterBrokerEndsControlStream(t *testing.T) {
	for name, end := range map[string]error{
		"with OK":          nil,
		"with Unavailable": status.Error(codes.Unavailable, "broker is shutting down"),
	} {
		t.Run(name, func(t *testing.T) {
			p := newPKI(t)
			b := startBroker(t, p)
			a := newAgent(t, p, b, staticResolver(t, "127.0.0.1:1"))
			clk := fakeClock(a)
			registered := make(chan string, 4)
			a.Registered = func(brokerID string) { registered <- brokerID }
			run(t, a)

			first := b.nextSession(t)
			testutil.Wait(t, "the first registration", registered)
			first.finish(end)
			first.ended(t)
			waitUntilWaiting(t, clk, "its backoff")
			clk.Step(30 * time.Second) // the longest backoff

			second := b.nextSession(t)
			if got := second.register.GetClusters(); !slices.Equal(got, []string{testCluster}) {
				t.Errorf("register again with clusters %v, want [%s]", got, testCluster)
			}
			testutil.Wait(t, "the second registration", registered)

			// The new session serves orders.
			second.order(t, &tunnelv1.DialOrder{DialId: 3, Target: &tunnelv1.Target{Cluster: "root:org"}})
			if f := second.failure(t); f.GetDialId() != 3 {
				t.Errorf("dial_failure for dial %d, want 3", f.GetDialId())
			}
		})
	}
}

func TestAgentRetriesRefusedRegistration(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	b.refusals <- status.Error(codes.PermissionDenied, "not yet")
	a := newAgent(t, p, b, staticResolver(t, "127.0.0.1:1"))
	clk := fakeClock(a)
	registered := make(chan string, 4)
	a.Registered = func(brokerID string) { registered <- brokerID }
	run(t, a)

	waitUntilWaiting(t, clk, "its backoff after the refusal")
	clk.Step(30 * time.Second)
	s := b.nextSession(t)
	if len(b.refusals) != 0 {
		t.Error("the agent registered without being refused first")
	}
	if s.register.GetAgentName() != "test-agent" {
		t.Errorf("register agent_name %q", s.register.GetAgentName())
	}
	testutil.Wait(t, "the registration", registered)
	// A probe's echo comes after the session's Registered call: by then
	// every call there was to be has been made.
	s.send(t, &tunnelv1.ConnectResponse{Message: &tunnelv1.ConnectResponse_Probe{Probe: &tunnelv1.Probe{Sequence: 1}}})
	s.next(t)
	if n := len(registered); n != 0 {
		t.Errorf("Registered called %d more times, want once: a refused attempt is no registration", n)
	}
}

func TestAgentEchoesProbes(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	run(t, newAgent(t, p, b, staticResolver(t, "127.0.0.1:1")))
	s := b.nextSession(t)

	for _, seq := range []uint64{1, 42, 1 << 60} {
		s.send(t, &tunnelv1.ConnectResponse{Message: &tunnelv1.ConnectResponse_Probe{Probe: &tunnelv1.Probe{Sequence: seq}}})
		m := s.next(t)
		if m.GetProbe() == nil || m.GetProbe().GetSequence() != seq {
			t.Errorf("agent answered probe %d with %v", seq, m)
		}
	}
}

func TestAgentKeepsServingOrdersAfterBrokerDrain(t *testing.T) {
	// A draining broker still routes its dials in flight: the agent keeps
	// serving orders on the session.
	p := newPKI(t)
	b := startBroker(t, p)
	run(t, newAgent(t, p, b, staticResolver(t, refusedAddr(t))))
	s := b.nextSession(t)

	s.send(t, &tunnelv1.ConnectResponse{Message: &tunnelv1.ConnectResponse_Drain{Drain: &tunnelv1.Drain{GraceMs: 1000}}})
	s.order(t, dialOrder(4))
	f := s.failure(t)
	if f.GetDialId() != 4 || codes.Code(f.GetCode()) != codes.Unavailable || f.GetMessage() == shuttingDown {
		t.Errorf("dial_failure{%d, %v, %q}, want the target's refusal", f.GetDialId(), codes.Code(f.GetCode()), f.GetMessage())
	}
}

// watchedResolver is a resolver whose clusters change.
type watchedResolver struct {
	funcResolver
	mu      sync.Mutex
	current []string
	changes chan struct{}
}

func (r *watchedResolver) Clusters() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.current)
}

func (r *watchedResolver) ClustersChanged() <-chan struct{} { return r.changes }

func (r *watchedResolver) set(clusters ...string) {
	r.mu.Lock()
	r.current = clusters
	r.mu.Unlock()
	select {
	case r.changes <- struct{}{}:
	default:
	}
}

func TestAgentReRegistersWhenClustersChange(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	r := &watchedResolver{current: []string{"root"}, changes: make(chan struct{}, 1)}
	run(t, newAgent(t, p, b, r))
	s := b.nextSession(t)
	if got := s.register.GetClusters(); !slices.Equal(got, []string{"root"}) {
		t.Fatalf("first register clusters %v", got)
	}

	r.set("root", "team-a")
	m := s.next(t)
	reg := m.GetRegister()
	if reg == nil {
		t.Fatalf("agent sent %T after its clusters changed, want register", m.GetMessage())
	}
	if !slices.Equal(reg.GetClusters(), []string{"root", "team-a"}) || reg.GetAgentName() != "test-agent" {
		t.Errorf("register{%v, %q}, want {[root team-a], test-agent}", reg.GetClusters(), reg.GetAgentName())
	}
}

func TestTunnelsOutliveLostControlStream(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	tg := listenTarget(t)
	run(t, newAgent(t, p, b, staticResolver(t, tg.addr())))
	s := b.nextSession(t)
	s.order(t, dialOrder(5))
	conn := tg.accept(t)
	tu := b.nextTunnel(t)

	s.finish(status.Error(codes.Unavailable, "control stream lost"))
	s.ended(t)
	b.nextSession(t) // the agent noticed, and registered again

	if err := tu.send([]byte("still")); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len("still"))
	if _, err := io.ReadFull(conn, got); err != nil || string(got) != "still" {
		t.Fatalf("target read %q, %v", got, err)
	}
	if _, err := conn.Write([]byte("here")); err != nil {
		t.Fatal(err)
	}
	if back, err := tu.recvN(len("here")); err != nil || string(back) != "here" {
		t.Fatalf("broker read %q, %v", back, err)
	}
}

// stopAsync calls stop in the background; the channel closes when it returns.
func stopAsync(stop func()) <-chan struct{} {
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		stop()
	}()
	return stopped
}

func TestDrainRefusesNewOrdersAndWaitsForTunnelsInFlight(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	tg := listenTarget(t)
	a := newAgent(t, p, b, staticResolver(t, tg.addr()))
	a.Grace = time.Minute
	fakeClock(a) // which the test never moves: the grace period never runs out
	stop := run(t, a)
	s := b.nextSession(t)
	s.order(t, dialOrder(1))
	conn := tg.accept(t)
	tu := b.nextTunnel(t)

	stopped := stopAsync(stop)
	wantDrainOfAMinute(t, s)
	wantOrderRefusedWhileDraining(t, b, s, tg)

	// The tunnel in flight still carries bytes, and Run waits for it.
	if err := tu.send([]byte("in flight")); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len("in flight"))
	if _, err := io.ReadFull(conn, got); err != nil || string(got) != "in flight" {
		t.Fatalf("target read %q, %v", got, err)
	}
	select {
	case <-stopped:
		t.Fatal("Run returned while a tunnel was in flight and its grace period ran")
	default:
	}

	// Once the tunnel ends cleanly, Run returns without waiting out the grace.
	endTunnelCleanly(t, tu, conn)
	testutil.Wait(t, "Run to return after its last tunnel ended", stopped)
	s.ended(t)
}

// wantDrainOfAMinute wants the next message on the control stream to be
// the Drain a stopping agent sends, with the agent's grace of a minute.
func wantDrainOfAMinute(t *testing.T, s *session) {
	t.Helper()
	m := s.next(t)
	if m.GetDrain() == nil {
		t.Fatalf("agent sent %T when its context ended, want drain", m.GetMessage())
	}
	if got := m.GetDrain().GetGraceMs(); got != 60000 {
		t.Errorf("drain grace_ms %d, want 60000", got)
	}
}

// wantOrderRefusedWhileDraining sends dial order 2 to a draining agent and
// wants it refused as Unavailable because the agent is shutting down,
// without the agent dialing the target or opening a tunnel.
func wantOrderRefusedWhileDraining(t *testing.T, b *fakeBroker, s *session, tg *target) {
	t.Helper()
	s.order(t, dialOrder(2))
	f := s.failure(t)
	if f.GetDialId() != 2 || codes.Code(f.GetCode()) != codes.Unavailable || f.GetMessage() != shuttingDown {
		t.Errorf("dial_failure{%d, %v, %q}, want {2, Unavailable, %q}", f.GetDialId(), codes.Code(f.GetCode()), f.GetMessage(), shuttingDown)
	}
	tg.noConnection(t)
	b.noTunnel(t)
}

// endTunnelCleanly half-closes the tunnel from the broker's end, then the
// target's, reads each direction to its end and ends the Tunnel stream
// without an error: the way a tunnel ends when neither end fails.
func endTunnelCleanly(t *testing.T, tu *tunnel, conn *net.TCPConn) {
	t.Helper()
	if err := tu.closeWrite(); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadAll(conn); err != nil {
		t.Fatal(err)
	}
	if err := conn.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if _, err := tu.recvAll(); err != nil {
		t.Fatal(err)
	}
	tu.finish(nil)
}

func TestDrainEndsTunnelsAfterGrace(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	tg := listenTarget(t)
	a := newAgent(t, p, b, staticResolver(t, tg.addr()))
	a.Grace = time.Minute
	clk := fakeClock(a)
	stop := run(t, a)
	s := b.nextSession(t)
	s.order(t, dialOrder(1))
	conn := tg.accept(t)
	tu := b.nextTunnel(t)

	// Neither end closes the tunnel.
	stopped := stopAsync(stop)
	waitUntilWaiting(t, clk, "the grace period")
	if err := tu.stream.Context().Err(); err != nil {
		t.Fatalf("the tunnel ended before the grace period was over: %v", err)
	}
	clk.Step(time.Minute)
	select {
	case <-tu.stream.Context().Done():
	case <-time.After(waitLong):
		t.Fatal("the tunnel did not end after the grace period")
	}
	if _, err := conn.Read(make([]byte, 1)); !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("target read after the grace period: %v, want a connection reset", err)
	}
	testutil.Wait(t, "Run to return", stopped)
	s.ended(t)
}

// TestDrainEndsATunnelWhoseTargetDoesNotReadAtTheEndOfItsGrace: the
// copier from the broker, blocked writing to the target, is freed when
// the agent cancels the Tunnel stream, long before its write's own bound.
func TestDrainEndsATunnelWhoseTargetDoesNotReadAtTheEndOfItsGrace(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	tg := listenTarget(t)
	a := newAgent(t, p, b, staticResolver(t, tg.addr()))
	a.Grace = time.Minute
	clk := fakeClock(a)
	stop := run(t, a)
	b.nextSession(t).order(t, dialOrder(1))
	conn := tg.accept(t) // and never read
	tu := b.nextTunnel(t)
	sending := sendUntilTheTargetsWriteBlocks(t, tu)

	stopped := stopAsync(stop)
	waitUntilWaiting(t, clk, "the grace period")
	clk.Step(time.Minute)
	testutil.Wait(t, "Run to return once the grace period is over", stopped)
	testutil.Wait(t, "the broker's sends to fail", sending)
	if _, err := io.Copy(io.Discard, conn); !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("target read after the grace period: %v, want a connection reset", err)
	}
}

// A stopping agent ends its registration the clean way: it closes its send
// direction, after its Drain, rather than cancelling the stream.
func TestStoppingAgentClosesItsControlStreamCleanly(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	a := newAgent(t, p, b, staticResolver(t, "127.0.0.1:1"))
	registered := make(chan string, 1)
	a.Registered = func(brokerID string) {
		select {
		case registered <- brokerID:
		default: // told once is enough
		}
	}
	stop := run(t, a)
	s := b.nextSession(t)
	// Stopped before it reads "registered", an agent just cancels.
	testutil.Wait(t, "the agent to read its registration", registered)

	stopped := stopAsync(stop)
	if m := s.next(t); m.GetDrain() == nil {
		t.Fatalf("agent sent %v before closing its send direction, want drain", m)
	}
	testutil.Wait(t, "the agent to close its send direction", s.closedSend)
	testutil.Wait(t, "Run to return", stopped)
}

// Until it is registered, a stopping agent has nothing to end cleanly: it
// stops at once, even while it waits for a broker it cannot reach.
func TestStoppingAgentThatCannotReachItsBrokerReturns(t *testing.T) {
	p := newPKI(t)
	a := &Agent{
		Broker:      "127.0.0.1:1", // refuses connections
		Credentials: p.agentCredentials(),
		Name:        "test-agent",
		Resolver:    staticResolver(t, "127.0.0.1:1"),
		Log:         slog.New(slog.NewTextHandler(t.Output(), nil)),
	}
	fakeClock(a) // which the test never moves: no wait may hold the agent up
	stop := run(t, a)
	testutil.Wait(t, "Run to return", stopAsync(stop))
}

// A broker that does not end a registration whose agent closed its send
// direction does not hold the stopping agent up for long.
func TestStoppingAgentCancelsItsControlStreamIfTheBrokerDoesNotEndIt(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	b.keepsClosedStreams = true
	a := newAgent(t, p, b, staticResolver(t, "127.0.0.1:1"))
	clk := fakeClock(a)
	registered := make(chan string, 1)
	a.Registered = func(brokerID string) { registered <- brokerID }
	stop := run(t, a)
	s := b.nextSession(t)
	testutil.Wait(t, "the agent to read its registration", registered)

	stopped := stopAsync(stop)
	testutil.Wait(t, "the agent to close its send direction", s.closedSend)
	waitUntilWaiting(t, clk, "the broker to end the registration")
	select {
	case <-stopped:
		t.Fatal("Run returned before the broker ended the registration or the agent stopped waiting for it")
	default:
	}
	clk.Step(unregisterTimeout)
	testutil.Wait(t, "Run to return", stopped)
	s.ended(t)
}
