package server

import (
	"errors"
	"fmt"
	"time"
)

// A replica that has just started has no agent yet. Were it ready at once,
// kcp would send it dials it can only refuse, and a rollout would take the
// old replica away before the agents have joined the new one. So a new
// replica becomes ready once the agents that come to it have come: when
// at least one has registered and then none for agentsSettle, or
// StartupGrace after it started at the latest, for a replica no agent
// joins. Agents that were registered with a replica that restarted come
// back within their reconnect ceiling (2s by default), so a restart is
// ready a few seconds after it serves; agents find a new replica on their
// next resolve of --broker-dns, which the rollout's minReadySeconds covers
// (deploy/README.md).
const (
	// DefaultStartupGrace covers the agents' resolve interval (30s) and
	// reconnect ceiling (2s), with a margin.
	DefaultStartupGrace = 35 * time.Second
	agentsSettle        = 3 * time.Second
)

var errDraining = errors.New("draining: SIGTERM received, tunnels in flight run for --grace, new dials are refused")

// Ready reports whether the replica takes dials (NotReady).
func (s *Server) Ready() bool { return s.NotReady() == nil }

// NotReady is nil when the replica takes dials, for /readyz; else it says
// why not: it drains, or its agents are still arriving.
func (s *Server) NotReady() error {
	if s.draining.Err() != nil {
		return errDraining
	}
	if s.settled.Load() {
		return nil
	}
	up := time.Since(s.started)
	st := s.Registry.Stats()
	if s.cfg.StartupGrace < 0 || up >= s.cfg.StartupGrace ||
		st.Agents > 0 && time.Since(s.Registry.LastRegistered()) >= agentsSettle {
		s.settled.Store(true)
		return nil
	}
	return fmt.Errorf("starting: %d agents registered so far; ready once none has registered for %v, or %v after the start at the latest (--startup-grace)",
		st.Agents, agentsSettle, (s.cfg.StartupGrace - up).Round(time.Second))
}
