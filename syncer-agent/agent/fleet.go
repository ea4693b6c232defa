package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"k8s.io/utils/clock"
)

// Fleet keeps the agent registered with every broker replica, so any replica
// can route any dial without state shared between replicas. Replicas come
// from a fixed list and/or a DNS name that resolves to all of them (a
// headless Service), resolved again periodically: new replicas are joined,
// vanished ones left.
type Fleet struct {
	// Addresses are fixed host:port addresses of replicas.
	Addresses []string
	// DNS, if set, is a host:port whose host resolves to every replica.
	DNS string
	// LoadBalancer, if set instead of Addresses and DNS, is one host:port
	// in front of every replica (a load balancer that passes TCP, or TLS,
	// through): see balanced.go.
	LoadBalancer string
	// SeekEvery is the least wait between two connections through
	// LoadBalancer while replicas are missing (zero: DefaultSeekEvery).
	SeekEvery time.Duration
	// ResolveEvery is how often DNS is resolved again.
	ResolveEvery time.Duration
	// Agent makes the agent for one replica's address.
	Agent func(address string) *Agent
	// LookupHost resolves DNS's host; nil means the system resolver.
	LookupHost func(ctx context.Context, host string) ([]string, error)
	// SVID, if set, is the agent's SVID source, looked at every
	// CheckSVIDEvery (5s if not positive). Each time its SVID rotates, the
	// fleet moves to new connections: for every replica a new agent
	// registers, and then the one it replaces drains as if its replica had
	// left. A broker holds a connection to the SVID it was opened with,
	// and ends the registration on it once that SVID expires.
	SVID           x509svid.Source
	CheckSVIDEvery time.Duration
	// Clock times the resolving and the SVID checks; nil means the real
	// clock.
	Clock clock.WithTicker
	Log   *slog.Logger

	mu      sync.Mutex
	members map[string]*member
	// successors are agents started by an SVID rotation, by address, that take the
	// member's place once registered.
	successors map[string]*member
	leaving    []*member // draining, awaited when the fleet ends
	balanced   balancedState
}

type member struct {
	agent *Agent
	stop  context.CancelFunc
	done  chan struct{} // closed when the agent's Run has returned
	// Behind one address (balanced.go), guarded by Fleet.mu: the replica
	// it registered with, how many replicas that one counts, the SVID
	// rotation it was started after, and whether its connection nears
	// its age (Agent.Retiring).
	brokerID     string
	registeredAt time.Time
	replicas     int
	generation   int
	retiring     bool
}

// Run follows the replicas until ctx ends, then drains every agent at once.
func (f *Fleet) Run(ctx context.Context) error {
	var svid *svidWatch
	if f.SVID != nil {
		svid = watchSVID(f.SVID)
	}
	if f.LoadBalancer != "" {
		return f.runBalanced(ctx, svid)
	}
	resolve, stopResolving := f.ticker(f.DNS != "", f.ResolveEvery, 30*time.Second)
	defer stopResolving()
	checkSVID, stopChecking := f.ticker(svid != nil, f.CheckSVIDEvery, 5*time.Second)
	defer stopChecking()
	f.update(ctx, f.resolve(ctx))
	for {
		select {
		case <-resolve:
			f.update(ctx, f.resolve(ctx))
		case <-checkSVID:
			if f.checkSVID(svid) {
				f.renew(ctx)
			}
		case <-ctx.Done():
			f.stopAll()
			return nil
		}
	}
}

// checkSVID reports whether the SVID rotated; if it did not and expires
// soon, it says so.
func (f *Fleet) checkSVID(svid *svidWatch) (rotated bool) {
	if svid.rotated() {
		return true
	}
	if left, notAfter, warn := svid.expiring(f.clock().Now()); warn {
		f.Log.Warn(fmt.Sprintf("my SVID expires in %s and no new one has come: is the SPIRE agent (--spiffe-socket) running, or whatever renews --svid-cert?",
			left.Round(time.Second)), "expires_at", notAfter.UTC().Format(time.RFC3339))
	}
	return false
}

// ticker ticks every d, or every byDefault if d is not positive; when not
// on, it never ticks.
func (f *Fleet) ticker(on bool, d, byDefault time.Duration) (ticks <-chan time.Time, stop func()) {
	if !on {
		return nil, func() {}
	}
	if d <= 0 {
		d = byDefault
	}
	t := f.clock().NewTicker(d)
	return t.C(), t.Stop
}

func (f *Fleet) clock() clock.WithTicker {
	if f.Clock == nil {
		return clock.RealClock{}
	}
	return f.Clock
}

// stopAll stops every agent and waits for them to return.
func (f *Fleet) stopAll() {
	f.mu.Lock()
	members := f.leaving
	for _, m := range f.members {
		members = append(members, m)
	}
	for _, m := range f.successors {
		members = append(members, m)
	}
	members = append(members, f.balanced.pool...)
	f.members, f.successors, f.leaving, f.balanced.pool = nil, nil, nil, nil
	f.mu.Unlock()
	for _, m := range members {
		m.stop()
	}
	for _, m := range members {
		<-m.done
	}
}

// resolve returns the replicas' addresses now; on a DNS failure it keeps
// the addresses it had.
func (f *Fleet) resolve(ctx context.Context) []string {
	addrs := slices.Clone(f.Addresses)
	if f.DNS != "" {
		host, port, err := net.SplitHostPort(f.DNS)
		if err == nil {
			var ips []string
			lookup := f.LookupHost
			if lookup == nil {
				lookup = net.DefaultResolver.LookupHost
			}
			ips, err = lookup(ctx, host)
			for _, ip := range ips {
				addrs = append(addrs, net.JoinHostPort(ip, port))
			}
		}
		if err != nil {
			f.mu.Lock()
			for addr := range f.members {
				addrs = append(addrs, addr)
			}
			f.mu.Unlock()
			if len(addrs) == 0 {
				// Say it each time: until the name resolves, no dial
				// reaches this agent's clusters.
				f.Log.Error("resolving broker replicas failed and none is known: registered with no broker until it resolves",
					"dns", f.DNS, "error", err)
			} else {
				f.Log.Warn("resolving broker replicas failed, keeping the ones known", "dns", f.DNS, "known", len(addrs), "error", err)
			}
		}
	}
	slices.Sort(addrs)
	return slices.Compact(addrs)
}

// update starts agents for new addresses and drains those for vanished ones.
func (f *Fleet) update(ctx context.Context, addrs []string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if ctx.Err() != nil {
		return
	}
	if f.members == nil {
		f.members = map[string]*member{}
	}
	for addr, m := range f.members {
		if !slices.Contains(addrs, addr) {
			f.Log.Info("broker replica vanished, leaving it", "broker", addr)
			f.leave(m)
			delete(f.members, addr)
			if s := f.successors[addr]; s != nil {
				f.leave(s)
				delete(f.successors, addr)
			}
		}
	}
	for _, addr := range addrs {
		if _, ok := f.members[addr]; ok {
			continue
		}
		f.members[addr] = f.start(ctx, addr)
	}
}

// renew starts a successor for every member (see SVID).
func (f *Fleet) renew(ctx context.Context) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if ctx.Err() != nil {
		return
	}
	f.Log.Info("SVID rotated, moving to new connections", "brokers", len(f.members))
	if f.successors == nil {
		f.successors = map[string]*member{}
	}
	for addr := range f.members {
		if s := f.successors[addr]; s != nil {
			f.leave(s)
		}
		f.successors[addr] = f.start(ctx, addr)
	}
}

// start runs a new agent for the replica at addr. Callers hold f.mu.
func (f *Fleet) start(ctx context.Context, addr string) *member {
	a := f.Agent(addr)
	mctx, stop := context.WithCancel(ctx)
	m := &member{agent: a, stop: stop, done: make(chan struct{})}
	registered := a.Registered
	a.Registered = func(brokerID string) {
		if registered != nil {
			registered(brokerID)
		}
		if f.LoadBalancer != "" {
			f.registeredBalanced(m, brokerID)
		} else {
			f.promote(addr, m)
		}
	}
	a.Replicas = func(n int) {
		f.mu.Lock()
		defer f.mu.Unlock()
		m.replicas = min(n, maxReplicas)
	}
	a.Retiring = func() {
		f.mu.Lock()
		defer f.mu.Unlock()
		m.retiring = true
	}
	a.OneConnection = f.LoadBalancer != ""
	go func() {
		defer close(m.done)
		defer f.forget(m)
		_ = a.Run(mctx)
	}()
	return m
}

// forget drops a member whose agent has returned from those leaving, or
// they would pile up with every rollout, and from the pool behind one
// address, whose member returns when its connection is gone.
func (f *Fleet) forget(m *member) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.leaving = slices.DeleteFunc(f.leaving, func(l *member) bool { return l == m })
	f.balanced.pool = slices.DeleteFunc(f.balanced.pool, func(l *member) bool { return l == m })
}

// promote makes a registered successor the member for addr; the member it
// replaces drains.
func (f *Fleet) promote(addr string, s *member) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.successors[addr] != s {
		return
	}
	delete(f.successors, addr)
	if old := f.members[addr]; old != nil {
		f.leave(old)
	}
	f.members[addr] = s
}

// leave stops a member; it drains, and the fleet waits for it at its end.
// Callers hold f.mu.
func (f *Fleet) leave(m *member) {
	m.stop()
	f.leaving = append(f.leaving, m)
}

// Ready reports whether the agent is registered with every replica it knows
// of, and knows of at least one.
func (f *Fleet) Ready() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.LoadBalancer != "" {
		held, want := f.balancedStatus()
		return held > 0 && held >= want
	}
	if len(f.members) == 0 {
		return false
	}
	for _, m := range f.members {
		if !m.agent.IsRegistered() {
			return false
		}
	}
	return true
}

// NotReady is nil when the agent is registered with every replica it knows
// of, and knows of at least one; else it says why not, for /readyz.
func (f *Fleet) NotReady() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.LoadBalancer != "" {
		switch held, want := f.balancedStatus(); {
		case held == 0:
			return fmt.Errorf("not registered with any broker replica behind %s yet", f.LoadBalancer)
		case held < want:
			return fmt.Errorf("registered with %d of the %d broker replicas behind %s", held, want, f.LoadBalancer)
		}
		return nil
	}
	if len(f.members) == 0 {
		return errors.New("no broker replica known yet")
	}
	var missing []string
	for _, addr := range slices.Sorted(maps.Keys(f.members)) {
		if a := f.members[addr].agent; !a.IsRegistered() {
			missing = append(missing, a.notRegistered())
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("not registered with %d of %d broker replicas: %s", len(missing), len(f.members), strings.Join(missing, "; "))
	}
	return nil
}

// Registered is the number of replicas that hold the agent's registration.
func (f *Fleet) Registered() (registered, known int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.LoadBalancer != "" {
		held, want := f.balancedStatus()
		return held, max(held, want)
	}
	for _, m := range f.members {
		if m.agent.IsRegistered() {
			registered++
		}
	}
	return registered, len(f.members)
}
