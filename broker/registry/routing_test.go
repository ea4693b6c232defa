package registry

import (
	"maps"
	"slices"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/kcp-dev/tunnel-broker/internal/testutil"
)

// Which agent a dial goes to: one that serves the target's cluster,
// round-robin, skipping agents that drain.

func TestDialGoesToAnAgentServingTheCluster(t *testing.T) {
	r := New(Limits{})
	other := registerAgent(t, r, "other", "other")
	serving := registerAgent(t, r, "serving", "other", "root")

	tgt := target("root")
	d := startDial(t, r, tgt)
	o := nextOrder(t, serving)
	if !proto.Equal(o.GetTarget(), tgt) {
		t.Errorf("order names %v, want %v", o.GetTarget(), tgt)
	}
	if ms := o.GetTimeoutMs(); ms == 0 || ms > uint32(dialTimeout.Milliseconds()) {
		t.Errorf("order gives %d ms, want what is left of the dial's %v", ms, dialTimeout)
	}
	noOrder(t, other)
	if !d.running() {
		t.Errorf("the dial ended before its agent answered: %v", d.wait().err)
	}
}

func TestDialWithNoAgentForTheClusterIsUnavailable(t *testing.T) {
	r := New(Limits{})
	registerAgent(t, r, "a", "root")

	_, err := r.Dial(t.Context(), target("elsewhere"), nil)
	testutil.CheckStatus(t, "dial", err, codes.Unavailable, `no agent serves logical cluster "elsewhere"`)
}

func TestDialsTakeTurnsAmongTheAgentsOfACluster(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")
	b := registerAgent(t, r, "b", "root")

	var got []*Agent
	for range 4 {
		d := startDial(t, r, target("root"))
		to, _ := orderedTo(t, a, b)
		got = append(got, to)
		d.cancel()
		testutil.CheckStatus(t, "cancelled dial", d.wait().err, codes.Canceled, "context canceled")
	}
	if got[0] == got[1] || got[0] != got[2] || got[1] != got[3] {
		t.Errorf("dials went to %v, want the two agents in turn", got)
	}
}

func TestDrainingAgentGetsNoNewDials(t *testing.T) {
	r := New(Limits{})
	draining := registerAgent(t, r, "draining", "root")
	staying := registerAgent(t, r, "staying", "root")
	draining.Drain()
	if !draining.Draining() {
		t.Fatal("Draining() is false after Drain()")
	}

	for range 3 {
		d := startDial(t, r, target("root"))
		if to, o := orderedTo(t, draining, staying); to != staying {
			t.Errorf("dial %d went to the draining agent", o.GetDialId())
		}
		d.cancel()
		d.wait()
	}
}

func TestDrainingAgentStillGetsDialsWhenNoOtherServesTheCluster(t *testing.T) {
	r := New(Limits{})
	draining := registerAgent(t, r, "draining", "root")
	draining.Drain()

	startDial(t, r, target("root"))
	nextOrder(t, draining)
}

func TestDrainingAgentGetsDialsWhenTheOthersAreAtTheirLimit(t *testing.T) {
	r := New(Limits{MaxPendingPerCluster: 1})
	draining := registerAgent(t, r, "draining", "root")
	busy := registerAgent(t, r, "busy", "root")
	draining.Drain()

	orderedDial(t, r, "root", busy) // busy is at its limit of one pending dial now
	startDial(t, r, target("root"))
	nextOrder(t, draining)
}

func TestUnregisteredAgentGetsNoDials(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")
	r.Unregister(a)

	_, err := r.Dial(t.Context(), target("root"), nil)
	testutil.CheckStatus(t, "dial", err, codes.Unavailable, `no agent serves logical cluster "root"`)
	noOrder(t, a)
}

func TestUnregisterLeavesTheOtherAgentsOfTheCluster(t *testing.T) {
	r := New(Limits{})
	leaving := registerAgent(t, r, "leaving", "root")
	staying := registerAgent(t, r, "staying", "root")
	r.Unregister(leaving)

	for range 2 {
		startDial(t, r, target("root"))
		nextOrder(t, staying)
	}
	noOrder(t, leaving)
}

func TestUpdateRoutesTheNewClustersAndNotTheOldOnes(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "old", "kept")
	r.Update(a, []string{"kept", "new"})

	_, err := r.Dial(t.Context(), target("old"), nil)
	testutil.CheckStatus(t, "dial to a cluster the agent no longer serves", err, codes.Unavailable, `no agent serves logical cluster "old"`)
	for _, c := range []string{"kept", "new"} {
		startDial(t, r, target(c))
		if o := nextOrder(t, a); o.GetTarget().GetCluster() != c {
			t.Errorf("order for cluster %q, want %q", o.GetTarget().GetCluster(), c)
		}
	}
}

func TestUpdateLetsDialsAlreadyOrderedFinish(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "old")
	d, o := orderedDial(t, r, "old", a)

	r.Update(a, []string{"new"})
	tun := claim(t, "claim of a dial ordered before the update", r, o.GetDialId(), a.ID)
	if c := d.connected(); c.Tunnel() != tun {
		t.Fatal("the dial got another tunnel than the claim handed over")
	}
}

func TestUpdateChangesOnlyTheClustersThatChanged(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "x", "y", "z")
	b := registerAgent(t, r, "b", "y")
	r.Update(a, []string{"z", "w", "y"})

	if got := r.AgentsPerCluster(); !maps.Equal(got, map[string]int{"y": 2, "z": 1, "w": 1}) {
		t.Errorf("agents per cluster %v after the update", got)
	}
	if got := r.ClustersOf(a); !slices.Equal(got, []string{"z", "w", "y"}) {
		t.Errorf("a serves %v, want the new list", got)
	}
	// The round-robin of a cluster both still serve goes on.
	var got []*Agent
	for range 2 {
		d := startDial(t, r, target("y"))
		to, _ := orderedTo(t, a, b)
		got = append(got, to)
		d.cancel()
		d.wait()
	}
	if got[0] == got[1] {
		t.Errorf("dials to y both went to %s, want both agents in turn", got[0])
	}
}

func TestUpdateOfAnUnregisteredAgentRoutesNothing(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")
	r.Unregister(a)
	r.Update(a, []string{"new"})
	if got := r.AgentsPerCluster(); len(got) != 0 {
		t.Errorf("agents per cluster %v, want none", got)
	}
}

func TestDiffNamesWhatWasAddedAndRemoved(t *testing.T) {
	added, removed := diff([]string{"a", "b", "c"}, []string{"c", "d", "a", "e"})
	if !slices.Equal(added, []string{"d", "e"}) || !slices.Equal(removed, []string{"b"}) {
		t.Errorf("diff: added %v, removed %v; want [d e] and [b]", added, removed)
	}
}

// An agent's newer registration (same SPIFFE ID and name) supersedes the
// older: a restarted agent whose old connection lingers, silent.
func TestANewerRegistrationSupersedesTheOlder(t *testing.T) {
	r := New(Limits{})
	old := newTestAgent(t, "a", "/agent/a", "root", "only-old")
	r.Register(old)
	other := registerAgent(t, r, "other", "root") // another agent of the cluster
	newer := newTestAgent(t, "a", "/agent/a", "root")
	r.Register(newer)
	if !old.Superseded() || newer.Superseded() || other.Superseded() {
		t.Fatalf("superseded: old %v, newer %v, other %v; want only the old", old.Superseded(), newer.Superseded(), other.Superseded())
	}
	for range 4 {
		d := startDial(t, r, target("root"))
		if to, _ := orderedTo(t, newer, other); to != newer && to != other {
			t.Errorf("dial went to %s", to)
		}
		d.cancel()
		d.wait()
	}
	noOrder(t, old)
	// A cluster only the old registration serves still reaches it.
	startDial(t, r, target("only-old"))
	nextOrder(t, old)

	// Another name under the same SPIFFE ID is another agent.
	twin := newTestAgent(t, "b", "/agent/a", "root")
	r.Register(twin)
	if newer.Superseded() {
		t.Error("a registration of another name superseded the newer one")
	}
}
