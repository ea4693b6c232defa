package agent

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/internal/identity"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

func TestASpareTheBrokerOrdersOnIsReplaced(t *testing.T) {
	b, _, leg, _ := establishedOnData(t, dialOrder(1))
	leg.accepted(t)

	b.waitForSpares(t, 2)
	if n := b.dataAccepted.Load(); n != 3 {
		t.Errorf("the broker took %d data connections, want 3: two spares and the one replacing the spare used", n)
	}
}

func TestSparesAreOpenedAtMostTenASecond(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	tg := listenTarget(t)
	a := dataAgent(t, p, b, staticResolver(t, tg.addr()))
	clk := fakeClock(a)
	run(t, a)
	b.nextSession(t)
	b.waitForFullPool(t)

	var legs []*dataLeg
	for id := range uint64(2) {
		leg := b.orderOnData(t, dialOrder(id+1))
		tg.accept(t)
		leg.accepted(t)
		legs = append(legs, leg)
	}
	// The fake clock never ends the grace period: end the tunnels.
	defer func() {
		for _, l := range legs {
			l.reset()
		}
	}()
	// The two spares came at once; their replacements, a tenth of a
	// second apart.
	for want := range int32(2) {
		waitUntilWaiting(t, clk, "the pace of spares")
		if n := b.dataAccepted.Load(); n != 2+want {
			t.Fatalf("the broker took %d data connections before the pace allowed one more, want %d", n, 2+want)
		}
		clk.Step(100 * time.Millisecond)
		b.waitForSpares(t, want+1)
	}
}

func TestSparesAreClosedWhenTheSessionEnds(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	a := dataAgent(t, p, b, staticResolver(t, "127.0.0.1:1"))
	fakeClock(a) // which the test never moves: the agent does not register again
	run(t, a)
	s := b.nextSession(t)
	b.waitForFullPool(t)

	s.finish(nil)
	s.ended(t)
	testutil.Eventually(t, "the spares to be closed", func() bool { return b.sparesClosed.Load() == 2 })
	if n := b.spares.Load(); n != 0 {
		t.Errorf("%d spares still open after the session ended", n)
	}
	if n := b.dataAccepted.Load(); n != 2 {
		t.Errorf("the broker took %d data connections, want the 2 spares", n)
	}
}

func TestALostSpareIsReplaced(t *testing.T) {
	t.Run("refused at once", func(t *testing.T) {
		p := newPKI(t)
		b := startBroker(t, p)
		// As a broker over its bound of spares: the first is refused at once.
		b.refuseSpares.Store(1)
		a := dataAgent(t, p, b, staticResolver(t, "127.0.0.1:1"))
		logged := captureLog(t, a)
		run(t, a)
		b.nextSession(t)

		b.waitForSpares(t, 2)
		if n := b.dataAccepted.Load(); n != 3 {
			t.Errorf("the broker took %d data connections, want 3: the one refused, its replacement and the other", n)
		}
		if line := logged.line(t, "could not open a spare data connection"); !strings.Contains(line, "ResourceExhausted") {
			t.Errorf("the agent logged %q, want the broker's refusal in it", line)
		}
	})
	t.Run("closed while idle", func(t *testing.T) {
		p := newPKI(t)
		b := startBroker(t, p)
		a := dataAgent(t, p, b, staticResolver(t, "127.0.0.1:1"))
		logged := captureLog(t, a)
		run(t, a)
		b.nextSession(t)
		b.waitForFullPool(t)

		// As a broker that drains: a close_notify.
		b.closeASpare(t)
		testutil.Eventually(t, "the lost spare to be replaced", func() bool { return b.dataAccepted.Load() == 3 })
		b.waitForSpares(t, 2)
		if line := logged.waitLine(t, "spare data connection lost"); !strings.Contains(line, "close_notify") {
			t.Errorf("the agent logged %q, want the broker's close_notify in it", line)
		}
	})
}

func TestASparesBindNamesTheSessionOfItsControlStream(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	run(t, dataAgent(t, p, b, staticResolver(t, "127.0.0.1:1")))
	first := b.nextSession(t)
	b.waitForFullPool(t)
	if binds := b.bindsSoFar(); !slices.Equal(binds, []string{first.id, first.id}) {
		t.Fatalf("the spares bound to %q, want both to the session %q", binds, first.id)
	}

	// A new session binds new spares, to it: the broker forgot the old.
	first.finish(status.Error(codes.Unavailable, "control stream lost"))
	second := b.nextSession(t)
	testutil.Eventually(t, "the new session's spares", func() bool { return len(b.bindsSoFar()) == 4 })
	b.waitForSpares(t, 2)
	if binds := b.bindsSoFar(); !slices.Equal(binds[2:], []string{second.id, second.id}) {
		t.Errorf("the new session's spares bound to %q, want both to %q", binds[2:], second.id)
	}
}

func TestABindTheBrokerRefusesIsLoggedAndRetriedWithBackoff(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	// As a replica that does not know the session (behind a load
	// balancer), or whose control stream has just ended.
	b.forgetsSessions = true
	a := dataAgent(t, p, b, staticResolver(t, "127.0.0.1:1"))
	logged := captureLog(t, a)
	clk := fakeClock(a)
	run(t, a)
	s := b.nextSession(t)

	const failed = "could not open a spare data connection"
	for want := 1; want <= 3; want++ {
		testutil.Eventually(t, "the refusal to be logged", func() bool { return logged.count(failed) >= want })
		waitUntilWaiting(t, clk, "the backoff")
		if n := logged.count(failed); n != want {
			t.Fatalf("%d refused binds logged, want %d before the backoff passed", n, want)
		}
		clk.Step(maxRetry)
	}
	if line := logged.line(t, failed); !strings.Contains(line, "NotFound") || !strings.Contains(line, s.id) {
		t.Errorf("the agent logged %q, want the broker's refusal (NotFound, the session) in it", line)
	}
	if n := b.spares.Load(); n != 0 {
		t.Errorf("the broker holds %d spares, want none", n)
	}
}

func TestAFailedHandshakeIsLoggedAndRetriedWithBackoff(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	a := dataAgent(t, p, b, staticResolver(t, "127.0.0.1:1"))
	// An agent that takes the broker for another: every handshake fails.
	a.DataCredentials = wire.CoalesceWrites(identity.ClientCredentials(p.agent,
		tlsconfig.AuthorizeID(spiffeid.RequireFromString("spiffe://"+trustDomain+"/other")), identity.Protocols(wire.DataProtocol)))
	logged := captureLog(t, a)
	clk := fakeClock(a)
	run(t, a)
	b.nextSession(t)

	const failed = "could not open a spare data connection"
	for want := 1; want <= 3; want++ {
		testutil.Eventually(t, "the failure to be logged", func() bool { return logged.count(failed) >= want })
		waitUntilWaiting(t, clk, "the backoff")
		if n := logged.count(failed); n != want {
			t.Fatalf("%d failed handshakes logged, want %d before the backoff passed", n, want)
		}
		clk.Step(maxRetry)
	}
	if line := logged.line(t, failed); !strings.Contains(line, "spiffe://"+trustDomain+"/broker") {
		t.Errorf("the agent logged %q, want the cause (the broker's ID) in it", line)
	}
	if n := b.dataAccepted.Load(); n != 0 {
		t.Errorf("the broker took %d data connections", n)
	}
}

// count is how many lines logged hold what.
func (c *capturedLog) count(what string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, l := range c.lines {
		if strings.Contains(l, what) {
			n++
		}
	}
	return n
}
