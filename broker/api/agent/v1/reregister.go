package agent

import (
	"log/slog"
	"sync"

	"golang.org/x/time/rate"
	"k8s.io/utils/clock"

	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/broker/registry"
)

// An agent re-registers when the logical clusters it serves change: each
// re-registration states the whole list. Each costs the broker a check
// against the policy and a change of its routes under the registry's lock,
// so a control stream's lists are put in force at most
// MaxReregistrationsPerSecond a second. A list that comes sooner waits, and
// a later list replaces one that waits: the latest list wins, and an agent
// that sends lists in a tight loop costs the broker a few updates a second.

// reregistrations puts the lists of one control stream in force, paced.
type reregistrations struct {
	agent    *registry.Agent
	registry *registry.Registry
	clock    clock.WithDelayedExecution
	log      *slog.Logger

	mu      sync.Mutex // held while a list is put in force, so they apply in order
	limiter *rate.Limiter
	latest  []string    // the list that waits, if waiting
	waiting bool        // a list waits for timer
	timer   clock.Timer // armed while a list waits
	stopped bool
}

func (s *Service) newReregistrations(a *registry.Agent, log *slog.Logger) *reregistrations {
	perSecond := s.cfg.MaxReregistrationsPerSecond
	limit, burst := rate.Limit(perSecond), max(int(perSecond), 1)
	if perSecond < 0 {
		limit = rate.Inf
	}
	return &reregistrations{agent: a, registry: s.cfg.Registry, clock: s.cfg.Clock, log: log,
		limiter: rate.NewLimiter(limit, burst)}
}

// submit puts clusters in force now if the pace allows, else once it does,
// unless a later list comes first.
func (u *reregistrations) submit(clusters []string) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.stopped {
		return
	}
	u.latest = clusters
	if u.waiting {
		metrics.LimitsHit.WithLabelValues("reregistrations_superseded").Inc()
		return // the timer puts the latest list in force
	}
	u.waiting = true
	now := u.clock.Now()
	if u.limiter.AllowN(now, 1) {
		u.apply()
		return
	}
	delay := u.limiter.ReserveN(now, 1).DelayFrom(now)
	u.timer = u.clock.AfterFunc(delay, u.fire)
}

// fire puts the waiting list in force once the pace allows it.
func (u *reregistrations) fire() {
	u.mu.Lock()
	defer u.mu.Unlock()
	if !u.stopped && u.waiting {
		u.apply()
	}
}

// apply puts the latest list in force; u.mu is held.
func (u *reregistrations) apply() {
	clusters := u.latest
	u.latest, u.waiting, u.timer = nil, false, nil
	u.registry.Update(u.agent, clusters)
	u.log.Info("agent clusters changed", "clusters", len(clusters))
	u.log.Debug("agent clusters", "clusters", clusters)
}

// stop drops a list that waits: the control stream has ended.
func (u *reregistrations) stop() {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.stopped = true
	if u.timer != nil {
		u.timer.Stop()
	}
}
