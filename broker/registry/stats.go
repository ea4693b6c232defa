package registry

import (
	"sync/atomic"
	"time"
)

// A metrics scrape must not stop dials: with 100,000 clusters, copying the
// routing table under the registry's lock took milliseconds at every
// scrape. So the registry keeps its totals in atomics as routes change,
// and Stats reads them without the lock.

// Stats are the registry's totals.
type Stats struct {
	// Agents counts the registrations, also those serving no cluster.
	Agents int64
	// Clusters counts the logical clusters that at least one agent serves,
	// SingleAgentClusters those that exactly one serves (no HA).
	Clusters, SingleAgentClusters int64
}

// stats are Stats as they change; the registry's lock orders the changes.
type stats struct {
	agents, clusters, single atomic.Int64
	lastRegistered           atomic.Pointer[time.Time]
}

// routed counts a cluster's new route; n is its agents now.
func (s *stats) routed(n int) {
	switch n {
	case 1:
		s.clusters.Add(1)
		s.single.Add(1)
	case 2:
		s.single.Add(-1)
	}
}

// unrouted counts a cluster's route removed; n is its agents now.
func (s *stats) unrouted(n int) {
	switch n {
	case 0:
		s.clusters.Add(-1)
		s.single.Add(-1)
	case 1:
		s.single.Add(1)
	}
}

// Stats are the registry's totals, read without its lock.
func (r *Registry) Stats() Stats {
	return Stats{Agents: r.stats.agents.Load(), Clusters: r.stats.clusters.Load(), SingleAgentClusters: r.stats.single.Load()}
}

// LastRegistered is when an agent last registered; zero: never. A replica
// that starts is ready once its agents stop arriving (package server).
func (r *Registry) LastRegistered() time.Time {
	if t := r.stats.lastRegistered.Load(); t != nil {
		return *t
	}
	return time.Time{}
}
