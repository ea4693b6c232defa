package agent

import (
	"sync"
	"time"

	"k8s.io/utils/clock"

	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/broker/registry"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// prober sends probes over an agent's control stream and records answers.
// An agent that has not answered the previous probe when the next is due is
// marked unreachable.
type prober struct {
	agent  *registry.Agent
	series *metrics.AgentSeries
	clock  clock.PassiveClock

	mu      sync.Mutex
	seq     uint64
	sent    time.Time
	waiting bool
}

func newProber(a *registry.Agent, series *metrics.AgentSeries, clk clock.PassiveClock) *prober {
	return &prober{agent: a, series: series, clock: clk}
}

// next is the next probe to send.
func (p *prober) next() *tunnelv1.ConnectResponse {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.waiting {
		p.series.Reachable(false)
	}
	p.seq++
	p.sent = p.clock.Now()
	p.waiting = true
	return &tunnelv1.ConnectResponse{Message: &tunnelv1.ConnectResponse_Probe{Probe: &tunnelv1.Probe{Sequence: p.seq}}}
}

// answered records the agent's answer to probe seq; stale answers count for
// nothing.
func (p *prober) answered(seq uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if seq != p.seq || !p.waiting {
		return
	}
	p.waiting = false
	now := p.clock.Now()
	rtt := now.Sub(p.sent)
	p.agent.Probed(now, rtt)
	p.series.Probed(now, rtt)
}
