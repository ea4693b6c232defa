package registry

import (
	"cmp"
	"crypto/rand"
	"encoding/binary"
	"maps"
	"slices"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Registry routes dials to agents. It holds no state shared across broker
// replicas: every agent connects to every replica.
type Registry struct {
	limits Limits

	mu        sync.Mutex
	agents    map[*Agent]struct{} // every registered agent, even one serving no cluster
	byCluster map[string][]*Agent
	// bySelf holds the registrations of each agent, by SPIFFE ID and name,
	// so that a newer one supersedes the older ones.
	bySelf  map[self][]*Agent
	next    map[string]int // round-robin cursor per cluster
	pending map[uint64]*pending
	lastID  uint64

	stats stats // read without mu, by metrics scrapes
}

// Limits bound what one agent may be asked to carry. As in every Config of
// the broker, zero means the default, and a negative limit means none.
//
// No logical cluster's dials count against another's: a cluster whose
// targets hang (the agent's connect never completes) fills its own queue of
// pending dials on each agent and no other. So an agent has at most
// MaxPendingPerCluster dials pending for each cluster it serves.
type Limits struct {
	// MaxPendingPerCluster bounds the dials one agent has been ordered for
	// one logical cluster and has not yet answered, so that a stuck target
	// or agent cannot pile up waiting webhook calls; zero:
	// DefaultMaxPendingPerCluster.
	MaxPendingPerCluster int64
	// MaxTunnelsPerAgent bounds the tunnels open through one agent; zero:
	// DefaultMaxTunnelsPerAgent. A cluster's own pending dials count
	// against it too, since each may become a tunnel (otherwise dials that
	// arrive together would all pass it), but other clusters' pending dials
	// do not: the agent may exceed it by the dials of other clusters
	// pending at that moment.
	MaxTunnelsPerAgent int64
}

// Defaults of Limits.
const (
	DefaultMaxPendingPerCluster = 256
	DefaultMaxTunnelsPerAgent   = 20000
)

// Names of the limits, as LimitError and the limits_hit metric give them.
const (
	LimitPendingPerCluster = "pending_dials_per_cluster"
	LimitTunnelsPerAgent   = "tunnels_per_agent"
)

// LimitError is a dial refused because every agent of its cluster is at a
// limit. Its gRPC status is ResourceExhausted.
type LimitError struct {
	// Limit is LimitPendingPerCluster or LimitTunnelsPerAgent.
	Limit  string
	status *status.Status
}

func (e *LimitError) Error() string { return e.status.Err().Error() }

// GRPCStatus makes the error its status for grpc-go and package status.
func (e *LimitError) GRPCStatus() *status.Status { return e.status }

// New is an empty registry with limits, their defaults resolved.
func New(limits Limits) *Registry {
	limits.MaxPendingPerCluster = cmp.Or(limits.MaxPendingPerCluster, DefaultMaxPendingPerCluster)
	limits.MaxTunnelsPerAgent = cmp.Or(limits.MaxTunnelsPerAgent, DefaultMaxTunnelsPerAgent)
	var seed [8]byte
	_, _ = rand.Read(seed[:])
	return &Registry{
		limits:    limits,
		agents:    map[*Agent]struct{}{},
		byCluster: map[string][]*Agent{},
		bySelf:    map[self][]*Agent{},
		next:      map[string]int{},
		pending:   map[uint64]*pending{},
		// Dial IDs start at a random point so that IDs from an earlier
		// incarnation of this replica are unlikely to match a new dial.
		lastID: binary.BigEndian.Uint64(seed[:]) >> 1,
	}
}

// Register makes a routable for its clusters. It supersedes the agent's
// older registrations, those of the same SPIFFE ID and name: they get dials
// only for clusters that nothing else serves, as draining agents do. An
// agent that restarts, or that a partition hid while its old connection
// lingers, is so routed to its new registration at once, and dials to
// the old one in flight go on.
func (r *Registry) Register(a *Agent) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.agents[a] = struct{}{}
	r.stats.agents.Add(1)
	now := time.Now()
	r.stats.lastRegistered.Store(&now)
	for _, c := range a.Clusters {
		r.route(a, c)
	}
	for _, old := range r.bySelf[a.self()] {
		old.superseded.Store(true)
	}
	r.bySelf[a.self()] = append(r.bySelf[a.self()], a)
}

// Update makes a serve clusters instead of the clusters it served: it
// routes the clusters added and unroutes those removed, and leaves the
// others alone, so that the registry's lock is held for the change only.
// Dials already ordered go on. An agent that has unregistered stays
// unrouted. Calls for one agent must not overlap (its control stream
// makes them one after another).
func (r *Registry) Update(a *Agent, clusters []string) {
	added, removed := diff(a.Clusters, clusters)
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.agents[a]; !ok {
		return
	}
	r.unroute(a, removed)
	for _, c := range added {
		r.route(a, c)
	}
	a.Clusters = clusters
}

// diff is what is in new and not in old (added), and in old and not in new
// (removed).
func diff(old, new []string) (added, removed []string) {
	before := make(map[string]struct{}, len(old))
	for _, c := range old {
		before[c] = struct{}{}
	}
	for _, c := range new {
		if _, ok := before[c]; ok {
			delete(before, c)
		} else {
			added = append(added, c)
		}
	}
	for _, c := range old {
		if _, ok := before[c]; ok {
			removed = append(removed, c)
		}
	}
	return added, removed
}

// Unregister removes a and fails the dials that wait on it with
// Unavailable.
func (r *Registry) Unregister(a *Agent) {
	r.mu.Lock()
	if _, ok := r.agents[a]; ok {
		delete(r.agents, a)
		r.stats.agents.Add(-1)
		r.unroute(a, a.Clusters)
		k := a.self()
		if rest := slices.DeleteFunc(r.bySelf[k], func(x *Agent) bool { return x == a }); len(rest) > 0 {
			r.bySelf[k] = rest
		} else {
			delete(r.bySelf, k)
		}
	}
	r.mu.Unlock()
	a.markGone()
}

// unroute takes a out of the routing table of clusters; r.mu is held.
func (r *Registry) unroute(a *Agent, clusters []string) {
	for _, c := range clusters {
		agents := r.byCluster[c]
		for i, x := range agents {
			if x == a {
				agents = append(agents[:i:i], agents[i+1:]...)
				break
			}
		}
		if len(agents) == 0 {
			delete(r.byCluster, c)
			delete(r.next, c)
		} else {
			r.byCluster[c] = agents
		}
		r.stats.unrouted(len(agents))
	}
}

// route makes a routable for c; r.mu is held.
func (r *Registry) route(a *Agent, c string) {
	r.byCluster[c] = append(r.byCluster[c], a)
	r.stats.routed(len(r.byCluster[c]))
}

// ClustersOf is the clusters a serves now (they change when it re-registers).
func (r *Registry) ClustersOf(a *Agent) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(a.Clusters)
}

// AgentsPerCluster counts the agents serving each cluster.
func (r *Registry) AgentsPerCluster() map[string]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make(map[string]int, len(r.byCluster))
	for c, agents := range r.byCluster {
		out[c] = len(agents)
	}
	return out
}

// Agents lists the registered agents, also those that serve no cluster.
func (r *Registry) Agents() []*Agent {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Collect(maps.Keys(r.agents))
}

// pick chooses the next agent for cluster, round-robin, skipping agents
// that drain, are superseded or are at a limit, and never choosing skip
// (an agent the dial failed on; nil: none). A draining or superseded agent is used only when no
// other serves the cluster: it may still finish a dial within its grace
// period.
func (r *Registry) pick(cluster string, skip *Agent) (*Agent, error) {
	agents := r.byCluster[cluster]
	if len(agents) == 0 || len(agents) == 1 && agents[0] == skip {
		return nil, &NoAgentError{Cluster: cluster}
	}
	start := r.next[cluster]
	r.next[cluster] = start + 1
	var draining *Agent
	var limit string
	for i := range agents {
		a := agents[(start+i)%len(agents)]
		if a == skip {
			continue
		}
		if l := r.limitHit(a, cluster); l != "" {
			limit = l
			continue
		}
		if !a.Draining() && !a.Superseded() {
			return a, nil
		}
		if draining == nil {
			draining = a
		}
	}
	if draining != nil {
		return draining, nil
	}
	if limit == LimitPendingPerCluster {
		return nil, &LimitError{Limit: limit, status: status.Newf(codes.ResourceExhausted,
			"every agent of logical cluster %q has %d of its dials pending", cluster, r.limits.MaxPendingPerCluster)}
	}
	return nil, &LimitError{Limit: limit, status: status.Newf(codes.ResourceExhausted,
		"every agent of logical cluster %q carries %d tunnels", cluster, r.limits.MaxTunnelsPerAgent)}
}

// limitHit names the limit that keeps agent a from taking another dial for
// cluster, or is "" if none does. The caller holds r.mu.
//
// Only the cluster's own pending dials count, against both limits. They
// count against the tunnel limit because each may become a tunnel:
// otherwise a burst of dials would all pass it at once. Other clusters'
// pending dials do not count, so that no cluster uses up another's room.
//
// A dial that its agent has just claimed counts twice for a moment, as a
// pending dial and as a tunnel, until its Dial returns: the limit may then
// refuse a dial a moment early, but never let one through late.
func (r *Registry) limitHit(a *Agent, cluster string) string {
	l := r.limits
	pending := a.pending[cluster]
	switch {
	case l.MaxPendingPerCluster > 0 && pending >= l.MaxPendingPerCluster:
		return LimitPendingPerCluster
	case l.MaxTunnelsPerAgent > 0 && a.tunnels.Load()+pending >= l.MaxTunnelsPerAgent:
		return LimitTunnelsPerAgent
	}
	return ""
}
