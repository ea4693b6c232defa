package agent

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"
)

// Behind one address (Fleet.LoadBalancer), the fleet cannot name the
// replicas: each new connection reaches one the balancer picks. So it
// connects again and again, one connection at a time, until its
// connections hold registrations with as many distinct replicas (by
// broker_id) as the brokers count (tunnelv1.Replicas). A connection that
// reaches a replica held already takes over there, as the replica routes
// to the newest registration, and the older one drains. Each connection
// is an Agent with OneConnection: its Tunnel streams go where its control
// stream went, and when the connection goes, so does the member, and the
// fleet looks for that replica again.
//
// The brokers count a replica from its start until it is gone, and the
// balancer reaches it as long (a Service that publishes not-ready
// addresses): so a new replica gets its agents before it is ready, which
// makes it ready, and a draining replica stays held, and counted, until
// it goes, with nothing to look for in its place.

// Defaults of the seeking pace.
const (
	// DefaultSeekEvery is the least wait between two connections through
	// the load balancer.
	DefaultSeekEvery = time.Second
	// maxSeekWait is the most: after connections in a row that reached
	// replicas held already, the waits grow up to it.
	maxSeekWait = 30 * time.Second
	// pinnedPerReplica times the replicas (and at least pinnedAfter) is how
	// many such connections in a row make the fleet suspect a balancer
	// that pins this client to one replica: it then says so, and waits
	// longer between connections. A balancer that picks at random misses
	// the one replica missing of n that many times in a row about once in
	// a thousand tries (e^-7).
	pinnedPerReplica = 7
	pinnedAfter      = 10
	// countWait is how long after registering a replica must have sent
	// its count (Replicas), which it sends right after, before the fleet
	// says the brokers do not count.
	countWait = 5 * time.Second
	// maxReplicas is the most replicas a count is taken for. A broker
	// that counts more (its SVID is one of the trust domain's, not
	// necessarily a broker's) would only keep the agent looking.
	maxReplicas = 100
)

// balancedState is what the fleet keeps behind one address. Guarded by
// Fleet.mu.
type balancedState struct {
	pool          []*member // every connection, in the order they started
	generation    int       // raised by each SVID rotation
	nextSeek      time.Time
	wait          *backoff
	duplicates    int  // connections in a row that reached a replica held
	warnedPin     bool // said that the balancer seems to pin this client
	warnedNoCount bool
}

func (f *Fleet) seekEvery() time.Duration { return cmp.Or(max(f.SeekEvery, 0), DefaultSeekEvery) }

// runBalanced is Run behind one address.
func (f *Fleet) runBalanced(ctx context.Context, svid *svidWatch) error {
	f.mu.Lock()
	f.balanced = balancedState{wait: newBackoff(f.seekEvery(), maxSeekWait)}
	f.mu.Unlock()
	seek := f.clock().NewTicker(f.seekEvery())
	defer seek.Stop()
	checkSVID, stopChecking := f.ticker(svid != nil, f.CheckSVIDEvery, 5*time.Second)
	defer stopChecking()
	f.balance(ctx)
	for {
		select {
		case <-seek.C():
			f.balance(ctx)
		case <-checkSVID:
			if f.checkSVID(svid) {
				f.mu.Lock()
				f.balanced.generation++
				f.balanced.nextSeek = time.Time{}
				f.Log.Info("SVID rotated, moving to new connections", "brokers", len(f.held()))
				f.mu.Unlock()
				f.balance(ctx)
			}
		case <-ctx.Done():
			f.stopAll()
			return nil
		}
	}
}

// held is the member that holds each replica, by broker_id: of those
// registered there, the first in byPreference's order. Callers hold f.mu.
func (f *Fleet) held() map[string]*member {
	held := map[string]*member{}
	for _, m := range f.byPreference() {
		if m.brokerID != "" && m.agent.IsRegistered() && held[m.brokerID] == nil {
			held[m.brokerID] = m
		}
	}
	return held
}

// byPreference orders the pool as held prefers its members: a connection
// that is not retiring first, then the newest SVID's, then the last
// started, whose registration the replica routes to (a registration
// supersedes the older ones of the same agent on a replica).
func (f *Fleet) byPreference() []*member {
	pool := slices.Clone(f.balanced.pool)
	slices.Reverse(pool)
	slices.SortStableFunc(pool, rank)
	return pool
}

// rank orders two members by what they are, the start order aside: a
// connection that is not retiring first, then the newest SVID's.
func rank(a, b *member) int {
	if a.retiring != b.retiring {
		if a.retiring {
			return 1
		}
		return -1
	}
	return b.generation - a.generation
}

// wanted is the number of replicas the brokers count: the most any
// registered member heard (0: none did).
func (f *Fleet) wanted() int {
	n := 0
	for _, m := range f.balanced.pool {
		if m.brokerID != "" {
			n = max(n, m.replicas)
		}
	}
	return n
}

// heldUncounted reports whether a replica has held the agent's
// registration for countWait and sent no count. Callers hold f.mu.
func (f *Fleet) heldUncounted(held map[string]*member) bool {
	for _, m := range held {
		if f.clock().Since(m.registeredAt) >= countWait {
			return true
		}
	}
	return false
}

// balance lets every member that duplicates another's replica leave, and
// opens one more connection when replicas are missing and none is on its
// way.
func (f *Fleet) balance(ctx context.Context) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if ctx.Err() != nil {
		return
	}
	b := &f.balanced
	held := f.held()
	current, connecting := 0, 0
	for _, m := range slices.Clone(b.pool) { // leaveBalanced deletes from the pool
		switch {
		case m.brokerID == "":
			if m.generation == b.generation {
				connecting++
			}
		case !m.agent.IsRegistered():
			// Between two sessions on its connection, or draining.
		case held[m.brokerID] != m:
			f.Log.Info("a newer connection holds this broker replica: leaving it", "broker", f.LoadBalancer, "broker_id", m.brokerID)
			f.leaveBalanced(m)
		case m.generation == b.generation && !m.retiring:
			current++
		}
	}
	want := f.wanted()
	if want == 0 && !b.warnedNoCount && f.heldUncounted(held) {
		b.warnedNoCount = true
		f.Log.Error("the broker does not count its replicas (its --replicas-dns is not set): behind one address this agent cannot tell how many to reach, and holds a registration with only those it reaches", "broker", f.LoadBalancer)
	}
	now := f.clock().Now()
	if current >= max(want, 1) || connecting > 0 || now.Before(b.nextSeek) {
		return
	}
	b.nextSeek = now.Add(f.seekEvery())
	m := f.start(ctx, f.LoadBalancer)
	m.generation = b.generation
	b.pool = append(b.pool, m)
}

// registeredBalanced notes the replica m reached. A member that reached a
// replica held already takes it over, and the next connection waits
// longer.
func (f *Fleet) registeredBalanced(m *member, brokerID string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	b := &f.balanced
	if !slices.Contains(b.pool, m) {
		return
	}
	prev := f.held()[brokerID]
	m.brokerID, m.registeredAt = brokerID, f.clock().Now()
	if prev == nil || prev == m || rank(m, prev) < 0 {
		b.duplicates = 0
		b.wait.reset()
		b.nextSeek = time.Time{}
		if prev != nil && prev != m {
			f.leaveBalanced(prev)
		}
		return
	}
	// The replica routes to the newest registration: the new connection
	// takes over, and the old one drains.
	f.Log.Info("connection reached a broker replica held already: moving to it", "broker", f.LoadBalancer, "broker_id", brokerID)
	f.leaveBalanced(prev)
	b.duplicates++
	pinned := b.duplicates >= max(pinnedAfter, pinnedPerReplica*f.wanted())
	wait := f.seekEvery()
	if pinned {
		wait = b.wait.next()
	}
	b.nextSeek = f.clock().Now().Add(wait)
	if pinned && !b.warnedPin {
		b.warnedPin = true
		f.Log.Warn(fmt.Sprintf("%d connections in a row reached broker replicas this agent holds already: does the load balancer pin a client to one replica (session affinity)? Behind one address, an agent needs its connections spread over the replicas", b.duplicates),
			"broker", f.LoadBalancer, "held", len(f.held()), "replicas", f.wanted())
	}
}

// leaveBalanced lets m drain and leave the pool. Callers hold f.mu.
func (f *Fleet) leaveBalanced(m *member) {
	f.balanced.pool = slices.DeleteFunc(f.balanced.pool, func(p *member) bool { return p == m })
	f.leave(m)
}

// balancedStatus is how many replicas the fleet holds registrations with,
// and how many the brokers count (0: they do not count). Callers hold f.mu.
func (f *Fleet) balancedStatus() (held, want int) {
	for _, m := range f.held() {
		if m.agent.IsRegistered() {
			held++
		}
	}
	return held, f.wanted()
}
