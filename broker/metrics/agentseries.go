package metrics

import (
	"slices"
	"sync"
	"time"
)

// AgentSeries writes the series of one agent registration: reachable, probe
// round trip and last probe, labelled with the agent's name and SPIFFE ID.
// Several registrations of one agent (an agent that reconnects before its
// old stream ends) share those labels, so the newest one writes them; the
// others' writes are dropped. When the last of them ends, the series are
// deleted, so that agents that come and go leave nothing behind.
type AgentSeries struct {
	labels [2]string
}

var agentSeries = struct {
	sync.Mutex
	// registrations by labels, oldest first; the last one writes.
	live map[[2]string][]*AgentSeries
}{live: map[[2]string][]*AgentSeries{}}

// NewAgentSeries makes a new registration of the agent named name with
// SPIFFE ID id the writer of its series.
func NewAgentSeries(name, id string) *AgentSeries {
	s := &AgentSeries{labels: [2]string{name, id}}
	agentSeries.Lock()
	defer agentSeries.Unlock()
	agentSeries.live[s.labels] = append(agentSeries.live[s.labels], s)
	return s
}

// write runs f if s writes its agent's series; under the lock, so that no
// write follows the series' deletion.
func (s *AgentSeries) write(f func(agent, spiffeID string)) {
	agentSeries.Lock()
	defer agentSeries.Unlock()
	if live := agentSeries.live[s.labels]; len(live) > 0 && live[len(live)-1] == s {
		f(s.labels[0], s.labels[1])
	}
}

// Reachable sets whether the agent answers its probes.
func (s *AgentSeries) Reachable(yes bool) {
	v := 0.0
	if yes {
		v = 1
	}
	s.write(func(agent, id string) { Reachable.WithLabelValues(agent, id).Set(v) })
}

// Probed records an answered probe.
func (s *AgentSeries) Probed(at time.Time, rtt time.Duration) {
	s.write(func(agent, id string) {
		ProbeRTT.WithLabelValues(agent, id).Set(rtt.Seconds())
		ProbeSuccess.WithLabelValues(agent, id).Set(float64(at.UnixNano()) / 1e9)
		Reachable.WithLabelValues(agent, id).Set(1)
	})
}

// End ends the registration: the newest registration left writes the
// series from now on, and without one they are deleted.
func (s *AgentSeries) End() {
	agentSeries.Lock()
	defer agentSeries.Unlock()
	live := slices.DeleteFunc(agentSeries.live[s.labels], func(x *AgentSeries) bool { return x == s })
	if len(live) > 0 {
		agentSeries.live[s.labels] = live
		return
	}
	delete(agentSeries.live, s.labels)
	for _, v := range []interface{ DeleteLabelValues(...string) bool }{Reachable, ProbeRTT, ProbeSuccess} {
		v.DeleteLabelValues(s.labels[0], s.labels[1])
	}
}
