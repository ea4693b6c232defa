package agent

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kcp-dev/tunnel-broker/internal/testutil"
)

// fleetHarness runs a Fleet whose DNS answers come from the test, one
// lookup at a time, whose clock only the test moves, and whose agents
// register with a fake broker per replica address.
type fleetHarness struct {
	t       *testing.T
	pki     *pki
	fleet   *Fleet
	clock   *clocktesting.FakeClock
	brokers map[string]*fakeBroker // by the replica address the fleet uses
	// registered receives the replica address of each registration.
	registered chan string

	calls   chan struct{} // a lookup started and waits for its answer
	answers chan lookupAnswer
	pending bool // a call was received and not yet answered
	lookups int  // calls received

	mu   sync.Mutex
	made []string // addresses the fleet made agents for, in order
}

type lookupAnswer struct {
	ips []string
	err error
}

const fleetDNS = "brokers.test:8443"

// resolveEvery is the fleet's ResolveEvery, on its fake clock.
const resolveEvery = 30 * time.Second

// newFleet makes a fleet of the given fixed addresses and, if dns, of
// fleetDNS's answers, with a fake broker for each address in replicas.
func newFleet(t *testing.T, fixed []string, dns bool, replicas ...string) *fleetHarness {
	t.Helper()
	p := newPKI(t)
	h := &fleetHarness{
		t:          t,
		pki:        p,
		brokers:    map[string]*fakeBroker{},
		registered: make(chan string, 64),
		calls:      make(chan struct{}),
		answers:    make(chan lookupAnswer, 1),
		clock:      clocktesting.NewFakeClock(time.Now()),
	}
	for _, addr := range replicas {
		h.brokers[addr] = startBroker(t, p)
	}
	resolver := staticResolver(t, "127.0.0.1:1")
	h.fleet = &Fleet{
		Addresses:    fixed,
		ResolveEvery: resolveEvery,
		Clock:        h.clock,
		Log:          slog.New(slog.NewTextHandler(t.Output(), nil)),
		Agent: func(addr string) *Agent {
			h.mu.Lock()
			h.made = append(h.made, addr)
			h.mu.Unlock()
			b, ok := h.brokers[addr]
			if !ok {
				t.Errorf("the fleet joined %s, which it was never given", addr)
				b = h.brokers[replicas[0]]
			}
			a := newAgent(t, p, b, resolver)
			a.Name = addr
			a.Registered = func(string) { h.registered <- addr }
			return a
		},
		LookupHost: func(ctx context.Context, host string) ([]string, error) {
			if host != "brokers.test" {
				t.Errorf("LookupHost(%q), want brokers.test", host)
			}
			select {
			case h.calls <- struct{}{}:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
			select {
			case a := <-h.answers:
				return a.ips, a.err
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		},
	}
	if dns {
		h.fleet.DNS = fleetDNS
	}
	return h
}

// run runs the fleet until the returned stop is called or the test ends.
func (h *fleetHarness) run() (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.fleet.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					h.t.Errorf("Fleet.Run: %v", err)
				}
			case <-time.After(waitLong):
				h.t.Error("Fleet.Run did not return after its context ended")
			}
		})
	}
	h.t.Cleanup(stop)
	return stop
}

// parked waits until the fleet is in a lookup, waiting for its answer: it
// has applied every earlier answer and changes nothing until the next.
// Lookups after the first wait for the resolve interval, which parked
// moves the fleet's clock by.
func (h *fleetHarness) parked() {
	h.t.Helper()
	if h.pending {
		return
	}
	if h.lookups > 0 {
		h.clock.Step(resolveEvery)
	}
	testutil.Wait(h.t, "the fleet to resolve "+fleetDNS, h.calls)
	h.pending = true
	h.lookups++
}

// answer answers the fleet's next lookup.
func (h *fleetHarness) answer(ips []string, err error) {
	h.t.Helper()
	h.parked()
	h.pending = false
	h.answers <- lookupAnswer{ips: ips, err: err}
}

// session waits for the agent's registration with the replica at addr.
func (h *fleetHarness) session(addr string) *session {
	h.t.Helper()
	s := h.brokers[addr].nextSession(h.t)
	if got := s.register.GetAgentName(); got != addr {
		h.t.Errorf("replica %s got a registration from the agent for %s", addr, got)
	}
	return s
}

func (h *fleetHarness) joined() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.made)
}

func (h *fleetHarness) known(want int) {
	h.t.Helper()
	if _, known := h.fleet.Registered(); known != want {
		h.t.Errorf("the fleet knows %d replicas, want %d", known, want)
	}
}

func TestFleetJoinsEveryResolvedReplicaAndFixedAddress(t *testing.T) {
	h := newFleet(t, []string{"fixed.test:9443"}, true, "fixed.test:9443", "10.0.0.1:8443", "10.0.0.2:8443")
	h.run()

	h.parked()
	if h.fleet.Ready() {
		t.Error("Ready before any replica is known")
	}
	h.answer([]string{"10.0.0.2", "10.0.0.1"}, nil)
	for _, addr := range []string{"fixed.test:9443", "10.0.0.1:8443", "10.0.0.2:8443"} {
		h.session(addr)
	}
	for range 3 {
		testutil.Wait(t, "a registration", h.registered)
	}
	if !h.fleet.Ready() {
		t.Error("not Ready once every replica confirmed the registration")
	}
	if reg, known := h.fleet.Registered(); reg != 3 || known != 3 {
		t.Errorf("Registered() = %d, %d; want 3, 3", reg, known)
	}

	// Answers that do not change the set change nothing.
	h.answer([]string{"10.0.0.1", "10.0.0.2"}, nil)
	h.parked()
	if got := h.joined(); len(got) != 3 {
		t.Errorf("the fleet made agents for %v, want one per replica", got)
	}
}

func TestFleetLeavesReplicaThatVanishesFromDNS(t *testing.T) {
	h := newFleet(t, nil, true, "10.0.0.1:8443", "10.0.0.2:8443", "10.0.0.3:8443")
	h.run()
	h.answer([]string{"10.0.0.1", "10.0.0.2", "10.0.0.3"}, nil)
	sessions := map[string]*session{}
	for addr := range h.brokers {
		sessions[addr] = h.session(addr)
	}

	h.answer([]string{"10.0.0.1", "10.0.0.2"}, nil)
	sessions["10.0.0.3:8443"].ended(t)
	h.parked()
	h.known(2)
	if got := h.joined(); len(got) != 3 {
		t.Errorf("the fleet made agents for %v, want one per replica", got)
	}

	// A replica that comes back is joined again.
	h.answer([]string{"10.0.0.1", "10.0.0.2", "10.0.0.3"}, nil)
	h.session("10.0.0.3:8443")
	h.parked()
	h.known(3)
}

func TestFleetKeepsKnownReplicasWhenResolutionFails(t *testing.T) {
	h := newFleet(t, nil, true, "10.0.0.1:8443", "10.0.0.2:8443")
	h.run()
	h.answer([]string{"10.0.0.1", "10.0.0.2"}, nil)
	h.session("10.0.0.1:8443")
	h.session("10.0.0.2:8443")

	h.answer(nil, errors.New("no such host"))
	h.parked()
	h.known(2)
	if got := h.joined(); len(got) != 2 {
		t.Errorf("the fleet made agents for %v, want one per replica", got)
	}

	// A failure after a change keeps the changed set.
	h.answer([]string{"10.0.0.1"}, nil)
	h.answer(nil, errors.New("server misbehaving"))
	h.parked()
	h.known(1)
}

func TestFleetDrainsEveryAgentWhenItEnds(t *testing.T) {
	h := newFleet(t, []string{"a.test:8443", "b.test:8443"}, false, "a.test:8443", "b.test:8443")
	stop := h.run()
	a, b := h.session("a.test:8443"), h.session("b.test:8443")

	stop()
	// Run returned: every agent's Run has returned too.
	a.ended(t)
	b.ended(t)
	h.known(0)
	if h.fleet.Ready() {
		t.Error("Ready after the fleet ended")
	}
}

func TestFleetForgetsReplicasOnceTheyHaveLeft(t *testing.T) {
	// A long-lived agent sees broker replicas come and go with every
	// rollout: those that have left must not pile up.
	h := newFleet(t, nil, true, "10.0.0.1:8443", "10.0.0.2:8443")
	h.run()
	h.answer([]string{"10.0.0.1", "10.0.0.2"}, nil)
	h.session("10.0.0.1:8443")
	h.session("10.0.0.2:8443")

	h.answer([]string{"10.0.0.1"}, nil)
	h.parked()
	h.fleet.mu.Lock()
	leaving := slices.Clone(h.fleet.leaving)
	h.fleet.mu.Unlock()
	if len(leaving) != 1 {
		t.Fatalf("%d agents leaving, want 1", len(leaving))
	}
	testutil.Wait(t, "the agent of the vanished replica to end", leaving[0].done)

	h.answer([]string{"10.0.0.1"}, nil)
	h.parked()
	h.fleet.mu.Lock()
	n := len(h.fleet.leaving)
	h.fleet.mu.Unlock()
	if n != 0 {
		t.Errorf("the fleet still holds %d agents that have left", n)
	}
}

// An agent whose --broker-dns has never resolved is registered with no
// broker: it says so at every attempt, not once as if it kept some.
func TestFleetThatKnowsNoReplicaSaysSoAtEveryFailedResolution(t *testing.T) {
	h := newFleet(t, nil, true, "10.0.0.1:8443")
	var logs testutil.LogBuffer
	h.fleet.Log = slog.New(slog.NewTextHandler(&logs, nil))
	h.run()
	h.answer(nil, errors.New("no such host"))
	h.answer(nil, errors.New("no such host"))
	h.parked()
	h.known(0)
	const said = "resolving broker replicas failed and none is known: registered with no broker until it resolves"
	if n := strings.Count(logs.String(), said); n != 2 {
		t.Errorf("said %d times %q, want at each of 2 failures; the log:\n%s", n, said, logs.String())
	}
}
