// Package replicas counts the broker's replicas, for agents that reach
// them through one address: replicas share nothing, so an agent must hold
// a registration with each, and behind a load balancer only the brokers
// can tell it how many there are.
package replicas

import (
	"cmp"
	"context"
	"errors"
	"log/slog"
	"net"
	"sync"
	"time"

	"k8s.io/utils/clock"
)

// DefaultEvery is how often a Counter resolves its name: agents know of a
// new replica within seconds of its start.
const DefaultEvery = 5 * time.Second

// Counter counts the replicas by resolving a DNS name, now and every
// Every. The name must list each replica from its start until it is gone,
// ready or not (a headless Service with publishNotReadyAddresses), as the
// agents' load balancer reaches them: agents then reach a new replica
// before it is ready (it is ready once its agents have come), and hold a
// draining one, still counted, until it goes. A name that does not
// resolve keeps the last count.
type Counter struct {
	// Name is the host name to resolve.
	Name string
	// Every is how often it is resolved again; zero: DefaultEvery.
	Every time.Duration
	// LookupHost resolves Name; nil: the system resolver.
	LookupHost func(ctx context.Context, host string) ([]string, error)
	Clock      clock.WithTicker
	Log        *slog.Logger

	mu      sync.Mutex
	count   int
	changed chan struct{}
	failing bool // the last lookup failed: said once until one succeeds
}

// Count is the number of replicas the name resolved to last (0 before it
// first resolved), and a channel closed when that changes.
func (c *Counter) Count() (n int, changed <-chan struct{}) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.changed == nil {
		c.changed = make(chan struct{})
	}
	return c.count, c.changed
}

// Run resolves the name now and every Every until ctx ends.
func (c *Counter) Run(ctx context.Context) {
	clk := c.Clock
	if clk == nil {
		clk = clock.RealClock{}
	}
	tick := clk.NewTicker(cmp.Or(c.Every, DefaultEvery))
	defer tick.Stop()
	for {
		c.resolve(ctx)
		select {
		case <-tick.C():
		case <-ctx.Done():
			return
		}
	}
}

func (c *Counter) resolve(ctx context.Context) {
	lookup := c.LookupHost
	if lookup == nil {
		lookup = net.DefaultResolver.LookupHost
	}
	log := cmp.Or(c.Log, slog.Default())
	addrs, err := lookup(ctx, c.Name)
	if ctx.Err() != nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if err == nil && len(addrs) == 0 {
		err = errors.New("the name resolves to no address (no replica listed)")
	}
	if err != nil {
		if !c.failing {
			log.Warn("cannot count the broker's replicas, keeping the last count", "replicas_dns", c.Name, "count", c.count, "error", err)
		}
		c.failing = true
		return
	}
	c.failing = false
	n := len(distinct(addrs))
	if n == c.count {
		return
	}
	log.Info("broker replicas counted", "replicas_dns", c.Name, "count", n, "was", c.count)
	c.count = n
	if c.changed != nil {
		close(c.changed)
	}
	c.changed = make(chan struct{})
}

func distinct(addrs []string) map[string]struct{} {
	set := make(map[string]struct{}, len(addrs))
	for _, a := range addrs {
		set[a] = struct{}{}
	}
	return set
}
