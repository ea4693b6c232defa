// Package registry keeps the agents connected to this broker replica, by the
// logical clusters they serve, and the dials waiting for an agent's tunnel.
package registry

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// Agent is one registration of an agent: its control stream, the clusters
// it serves, the dials it was ordered and the tunnels it carries.
type Agent struct {
	// SessionID names this registration of the agent in logs.
	SessionID string
	// ID is the agent's SPIFFE ID; only it may open tunnels for its dials.
	ID       spiffeid.ID
	Name     string
	Clusters []string
	Since    time.Time

	// orders is drained by the agent's control stream. Every send selects on
	// gone as well, so a vanished agent never blocks a dial.
	orders   chan *tunnelv1.DialOrder
	gone     chan struct{}
	goneOnce sync.Once

	draining atomic.Bool
	// superseded: a newer registration of the same agent (SPIFFE ID and
	// name) came; this one is used as a draining one.
	superseded atomic.Bool
	// pending counts the dials ordered and not yet answered, by logical
	// cluster; Registry.mu guards it.
	pending map[string]int64
	tunnels atomic.Int64 // tunnels open through the agent

	probeMu   sync.Mutex
	lastProbe time.Time // when the agent last answered a probe
	probeRTT  time.Duration
}

// Probed records an answered probe.
func (a *Agent) Probed(at time.Time, rtt time.Duration) {
	a.probeMu.Lock()
	defer a.probeMu.Unlock()
	a.lastProbe, a.probeRTT = at, rtt
}

// LastProbe is when the agent last answered a probe, and its round trip.
func (a *Agent) LastProbe() (time.Time, time.Duration) {
	a.probeMu.Lock()
	defer a.probeMu.Unlock()
	return a.lastProbe, a.probeRTT
}

// Drain marks the agent as shutting down: dials go to other agents of its
// clusters when there are any.
func (a *Agent) Drain() { a.draining.Store(true) }

// Draining reports whether the agent announced it is shutting down.
func (a *Agent) Draining() bool { return a.draining.Load() }

// Superseded reports whether a newer registration of the same agent (SPIFFE
// ID and name) has come to this replica.
func (a *Agent) Superseded() bool { return a.superseded.Load() }

// self is what tells agents apart: registrations with the same self are the
// same agent's, the later superseding the earlier.
type self struct {
	id   spiffeid.ID
	name string
}

func (a *Agent) self() self { return self{a.ID, a.Name} }

// Tunnels is the number of tunnels open through the agent.
func (a *Agent) Tunnels() int64 { return a.tunnels.Load() }

// NewAgent makes an agent ready to register.
func NewAgent(sessionID string, id spiffeid.ID, name string, clusters []string) *Agent {
	return &Agent{
		SessionID: sessionID,
		ID:        id,
		Name:      name,
		Clusters:  clusters,
		Since:     time.Now(),
		pending:   map[string]int64{},
		orders:    make(chan *tunnelv1.DialOrder, 64),
		gone:      make(chan struct{}),
	}
}

// Orders are the dial orders to send to the agent, in order.
func (a *Agent) Orders() <-chan *tunnelv1.DialOrder { return a.orders }

func (a *Agent) markGone() { a.goneOnce.Do(func() { close(a.gone) }) }

// String names the agent in messages: its name and SPIFFE ID.
func (a *Agent) String() string {
	if a.Name == "" {
		return a.ID.String()
	}
	return a.Name + " (" + a.ID.String() + ")"
}
