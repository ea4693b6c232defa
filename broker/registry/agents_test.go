package registry

import (
	"maps"
	"slices"
	"testing"
	"time"
)

// What the registry tells about its agents: for ListAgents, metrics and
// logs.

func TestAgentsListsEachRegisteredAgentOnce(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root", "other")
	b := registerAgent(t, r, "b", "root")

	got := r.Agents()
	if len(got) != 2 || !slices.Contains(got, a) || !slices.Contains(got, b) {
		t.Errorf("Agents() = %v, want a and b once each", got)
	}
}

func TestAgentsOmitsUnregisteredAgents(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")
	b := registerAgent(t, r, "b", "root")
	r.Unregister(a)

	if got := r.Agents(); len(got) != 1 || got[0] != b {
		t.Errorf("Agents() = %v, want only b", got)
	}
}

func TestAgentServingNoClusterIsListed(t *testing.T) {
	// An agent may serve no cluster for a while (a sync target no workspace
	// uses yet); it is connected all the same, and may carry tunnels.
	r := New(Limits{})
	idle := registerAgent(t, r, "idle")
	emptied := registerAgent(t, r, "emptied", "root")
	r.Update(emptied, nil)

	got := r.Agents()
	if len(got) != 2 || !slices.Contains(got, idle) || !slices.Contains(got, emptied) {
		t.Errorf("Agents() = %v, want both agents, which serve no cluster", got)
	}
}

func TestUpdateAfterUnregisterRoutesNothing(t *testing.T) {
	// The control stream's receiver may still apply a re-registration the
	// agent sent as the stream ended: the agent is gone all the same.
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")
	r.Unregister(a)
	r.Update(a, []string{"root", "other"})

	if got := r.AgentsPerCluster(); len(got) != 0 {
		t.Errorf("AgentsPerCluster() = %v after the agent unregistered, want none", got)
	}
	if got := r.Agents(); len(got) != 0 {
		t.Errorf("Agents() = %v after the agent unregistered, want none", got)
	}
}

func TestAgentsPerClusterCountsTheAgentsServingEachCluster(t *testing.T) {
	r := New(Limits{})
	registerAgent(t, r, "a", "root", "other")
	b := registerAgent(t, r, "b", "root")
	c := registerAgent(t, r, "c", "gone")
	r.Update(b, []string{"root", "third"})
	r.Unregister(c)

	want := map[string]int{"root": 2, "other": 1, "third": 1}
	if got := r.AgentsPerCluster(); !maps.Equal(got, want) {
		t.Errorf("AgentsPerCluster() = %v, want %v", got, want)
	}
}

func TestClustersOfFollowsUpdates(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")
	if got := r.ClustersOf(a); !slices.Equal(got, []string{"root"}) {
		t.Errorf("ClustersOf = %v, want [root]", got)
	}
	r.Update(a, []string{"x", "y"})
	got := r.ClustersOf(a)
	if !slices.Equal(got, []string{"x", "y"}) {
		t.Errorf("ClustersOf after Update = %v, want [x y]", got)
	}
	// The answer is the caller's to keep: changing it changes no routing.
	got[0] = "root"
	if again := r.ClustersOf(a); !slices.Equal(again, []string{"x", "y"}) {
		t.Errorf("ClustersOf after changing its earlier answer = %v, want [x y]", again)
	}
}

func TestAgentIsNamedByItsNameAndSPIFFEID(t *testing.T) {
	named := newTestAgent(t, "sync-target-1", "/agent/a")
	if got, want := named.String(), "sync-target-1 (spiffe://example.org/agent/a)"; got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
	unnamed := newTestAgent(t, "", "/agent/b")
	if got, want := unnamed.String(), "spiffe://example.org/agent/b"; got != want {
		t.Errorf("String() of an agent without a name = %q, want %q", got, want)
	}
}

func TestLastProbeIsTheLatestAnswer(t *testing.T) {
	a := newTestAgent(t, "a", "/agent/a")
	if at, rtt := a.LastProbe(); !at.IsZero() || rtt != 0 {
		t.Errorf("LastProbe() of a new agent = %v, %v; want none", at, rtt)
	}
	first := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	a.Probed(first, 3*time.Millisecond)
	a.Probed(first.Add(10*time.Second), 5*time.Millisecond)
	if at, rtt := a.LastProbe(); !at.Equal(first.Add(10*time.Second)) || rtt != 5*time.Millisecond {
		t.Errorf("LastProbe() = %v, %v; want the second answer", at, rtt)
	}
}

func TestStatsFollowRegistrationsAndUpdates(t *testing.T) {
	r := New(Limits{})
	check := func(when string, want Stats) {
		t.Helper()
		if got := r.Stats(); got != want {
			t.Errorf("%s: stats %+v, want %+v", when, got, want)
		}
	}
	check("empty", Stats{})
	a := registerAgent(t, r, "a", "x", "y")
	check("one agent", Stats{Agents: 1, Clusters: 2, SingleAgentClusters: 2})
	b := registerAgent(t, r, "b", "y")
	registerAgent(t, r, "idle")
	check("y served twice, an idle agent", Stats{Agents: 3, Clusters: 2, SingleAgentClusters: 1})
	r.Update(a, []string{"z"})
	check("a moved to z", Stats{Agents: 3, Clusters: 2, SingleAgentClusters: 2})
	r.Unregister(b)
	r.Unregister(b) // a second time changes nothing
	check("b gone", Stats{Agents: 2, Clusters: 1, SingleAgentClusters: 1})
}
