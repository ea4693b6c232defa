package agent

import (
	"io"
	"runtime"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/internal/testutil"
)

// standbyAgent runs an agent of a fresh broker that keeps max standby
// streams per registration; the agent resolves the test target to tg, or
// to a refusing address if tg is nil. It returns the broker and the
// agent's session, once the agent has registered.
func standbyAgent(t *testing.T, max uint32, tg *target, configure func(*Agent)) (*fakeBroker, *session) {
	t.Helper()
	p := newPKI(t)
	b := startBroker(t, p)
	b.maxStandby = max
	addr := refusedAddr(t)
	if tg != nil {
		addr = tg.addr()
	}
	a := newAgent(t, p, b, staticResolver(t, addr))
	if configure != nil {
		configure(a)
	}
	run(t, a)
	return b, b.nextSession(t)
}

// nextStandbyOf waits for the agent's next standby stream and checks that
// it names s's registration.
func nextStandbyOf(t *testing.T, b *fakeBroker, s *session) *tunnel {
	t.Helper()
	sb := b.nextStandby(t)
	if got := sb.open.GetStandbyFor(); got != s.registrationID || sb.open.GetDialId() != 0 {
		t.Errorf("standby open{dial_id %d, standby_for %q}, want {0, %q}", sb.open.GetDialId(), got, s.registrationID)
	}
	return sb
}

func TestAnOrderOnAStandbyStreamIsClaimedOnThatStreamAndCarriesBytesBothWays(t *testing.T) {
	tg := listenTarget(t)
	b, s := standbyAgent(t, 2, tg, nil)
	sb := nextStandbyOf(t, b, s)

	sb.order(t, earlyOrder())
	conn := tg.accept(t)
	if id := sb.claimed(t); id != 1 {
		t.Fatalf("the agent claimed the standby stream for dial %d, want 1", id)
	}
	if err := sb.send([]byte("then data")); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len("client hello;then data"))
	if _, err := io.ReadFull(conn, got); err != nil || string(got) != "client hello;then data" {
		t.Fatalf("the target read %q, %v; want the early data, then the tunnel's data", got, err)
	}
	if _, err := conn.Write([]byte("answer")); err != nil {
		t.Fatal(err)
	}
	if back, err := sb.recvN(len("answer")); err != nil || string(back) != "answer" {
		t.Fatalf("broker read %q, %v", back, err)
	}
	endTunnelCleanly(t, sb, conn)
	b.noTunnel(t) // the order needed no Tunnel stream of its own
	select {
	case m := <-s.msgs:
		t.Errorf("agent sent %T on the control stream for an order it served on a standby stream", m.GetMessage())
	default:
	}
}

func TestATargetThatFailsOnAStandbyOrderIsADialFailureOnTheControlStreamAndTheStandbyIsClosed(t *testing.T) {
	b, s := standbyAgent(t, 1, nil, nil)
	sb := nextStandbyOf(t, b, s)

	sb.order(t, earlyOrder())
	f := s.failure(t)
	if f.GetDialId() != 1 || codes.Code(f.GetCode()) != codes.Unavailable || f.GetEarlyDataSent() ||
		!strings.Contains(f.GetMessage(), "connection refused") {
		t.Errorf("dial_failure{%d, %v, %q, early_data_sent %v}, want {1, Unavailable, the target's refusal, not sent}",
			f.GetDialId(), codes.Code(f.GetCode()), f.GetMessage(), f.GetEarlyDataSent())
	}
	sb.closedByAgent(t)
	sb.finish(nil)
	b.noTunnel(t)
	// Its replacement came as soon as it had its order.
	nextStandbyOf(t, b, s)
}

func TestTheAgentKeepsItsStandbyCountUpAfterOneIsUsed(t *testing.T) {
	tg := listenTarget(t)
	// The broker would keep three; the agent wants its default of two.
	b, s := standbyAgent(t, 3, tg, nil)
	first, second := nextStandbyOf(t, b, s), nextStandbyOf(t, b, s)

	first.order(t, dialOrder(1))
	conn := tg.accept(t)
	if id := first.claimed(t); id != 1 {
		t.Fatalf("the agent claimed the standby stream for dial %d, want 1", id)
	}
	third := nextStandbyOf(t, b, s)
	// The tunnel carries bytes, and then the count is two still: the one
	// unused and the one in the place of the one used.
	if _, err := conn.Write([]byte("up")); err != nil {
		t.Fatal(err)
	}
	if got, err := first.recvN(2); err != nil || string(got) != "up" {
		t.Fatalf("broker read %q, %v", got, err)
	}
	b.noStandby(t)

	// The replacement serves orders too, and is replaced in turn.
	third.order(t, dialOrder(2))
	tg.accept(t)
	if id := third.claimed(t); id != 2 {
		t.Fatalf("the agent claimed the replacement for dial %d, want 2", id)
	}
	nextStandbyOf(t, b, s)
	if err := second.stream.Context().Err(); err != nil {
		t.Errorf("the standby stream not used ended: %v", err)
	}
}

func TestNoStandbyStreamIsOpenedUnlessBothSidesWantThem(t *testing.T) {
	for name, tc := range map[string]struct {
		brokerMax uint32
		agentWant int
	}{
		"the broker keeps none": {brokerMax: 0},
		"the agent wants none":  {brokerMax: 2, agentWant: -1},
	} {
		t.Run(name, func(t *testing.T) {
			tg := listenTarget(t)
			b, s := standbyAgent(t, tc.brokerMax, tg, func(a *Agent) { a.StandbyStreams = tc.agentWant })
			// Orders come on the control stream, as ever.
			s.order(t, dialOrder(1))
			tg.accept(t)
			if tu := b.nextTunnel(t); tu.open.GetDialId() != 1 {
				t.Fatalf("Tunnel opened for dial %d, want 1", tu.open.GetDialId())
			}
			time.Sleep(50 * time.Millisecond) // time enough for standbys to come, if they would
			b.noStandby(t)
			if n := b.standbyOpens.Load(); n != 0 {
				t.Errorf("the agent opened %d standby streams, want none", n)
			}
		})
	}
}

func TestARefusedStandbyStreamIsOpenedAgainOnlyAfterAWait(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	b.maxStandby = 1
	b.standbyRefusals <- status.Error(codes.ResourceExhausted, "too many standby streams")
	b.standbyRefusals <- status.Error(codes.NotFound, "no such registration")
	a := newAgent(t, p, b, staticResolver(t, "127.0.0.1:1"))
	clk := fakeClock(a)
	run(t, a)
	s := b.nextSession(t)

	for refused := int32(1); refused <= 2; refused++ {
		waitUntilWaiting(t, clk, "its wait before it opens a standby stream again")
		time.Sleep(50 * time.Millisecond) // a tight loop would open more meanwhile
		if n := b.standbyOpens.Load(); n != refused {
			t.Fatalf("the agent opened %d standby streams after %d refusals, want %d: it must wait before it opens another", n, refused, refused)
		}
		clk.Step(maxStandbyRetry)
	}
	nextStandbyOf(t, b, s)
	if n := b.standbyOpens.Load(); n != 3 {
		t.Errorf("the agent opened %d standby streams, want 3", n)
	}
}

func TestADrainingAgentRefusesStandbyOrdersAndClosesItsIdleStandbys(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	b.maxStandby = 2
	tg := listenTarget(t)
	a := newAgent(t, p, b, staticResolver(t, tg.addr()))
	a.Grace = time.Minute
	fakeClock(a) // which the test never moves: the grace period never runs out
	stop := run(t, a)
	s := b.nextSession(t)
	first, second := nextStandbyOf(t, b, s), nextStandbyOf(t, b, s)
	// A tunnel in flight keeps the draining agent running.
	s.order(t, dialOrder(1))
	conn := tg.accept(t)
	tu := b.nextTunnel(t)

	stopped := stopAsync(stop)
	wantDrainOfAMinute(t, s)
	first.closedByAgent(t)
	second.closedByAgent(t)
	// An order that crossed the close is refused as the agent drains.
	first.order(t, dialOrder(2))
	f := s.failure(t)
	if f.GetDialId() != 2 || codes.Code(f.GetCode()) != codes.Unavailable || f.GetMessage() != shuttingDown {
		t.Errorf("dial_failure{%d, %v, %q}, want {2, Unavailable, %q}", f.GetDialId(), codes.Code(f.GetCode()), f.GetMessage(), shuttingDown)
	}
	first.finish(nil)
	second.finish(nil)
	wantOrderRefusedWhileDraining(t, b, s, tg)
	b.noStandby(t)

	endTunnelCleanly(t, tu, conn)
	testutil.Wait(t, "Run to return after its last tunnel ended", stopped)
	b.noStandby(t)
	if n := b.standbyOpens.Load(); n != 2 {
		t.Errorf("the agent opened %d standby streams, want 2: none once it drains", n)
	}
}

func TestTheEndOfASessionEndsItsIdleStandbysAndTheirGoroutines(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	b.maxStandby = 2
	a := newAgent(t, p, b, staticResolver(t, "127.0.0.1:1"))
	fakeClock(a) // which the test never moves: the agent does not register again
	run(t, a)
	s := b.nextSession(t)
	ended, idle := nextStandbyOf(t, b, s), nextStandbyOf(t, b, s)
	// As the broker does when the registration ends: the agent waits
	// before it opens another, and the session's end ends the wait.
	ended.finish(status.Error(codes.Unavailable, "the registration ended"))

	s.finish(status.Error(codes.Unavailable, "control stream lost"))
	s.ended(t)
	select {
	case <-idle.stream.Context().Done():
	case <-time.After(waitLong):
		t.Fatal("the idle standby stream outlived its session")
	}
	testutil.Eventually(t, "the standby streams' goroutines to return", func() bool { return standbyGoroutines() == 0 })
	b.noStandby(t)
}

// TestAStandbyStreamsTunnelOutlivesItsSession: a claimed standby stream is
// a tunnel like any other, whose stream is its own.
func TestAStandbyStreamsTunnelOutlivesItsSession(t *testing.T) {
	tg := listenTarget(t)
	b, s := standbyAgent(t, 1, tg, nil)
	sb := nextStandbyOf(t, b, s)
	sb.order(t, dialOrder(1))
	conn := tg.accept(t)
	if id := sb.claimed(t); id != 1 {
		t.Fatalf("the agent claimed the standby stream for dial %d, want 1", id)
	}

	s.finish(status.Error(codes.Unavailable, "control stream lost"))
	s.ended(t)
	if err := sb.send([]byte("still")); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len("still"))
	if _, err := io.ReadFull(conn, got); err != nil || string(got) != "still" {
		t.Fatalf("target read %q, %v", got, err)
	}
	endTunnelCleanly(t, sb, conn)
}

// standbyGoroutines counts the goroutines that keep a standby stream.
func standbyGoroutines() int {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return strings.Count(string(buf[:n]), "agent.(*standbys).keep(")
		}
		buf = make([]byte, 2*len(buf))
	}
}
