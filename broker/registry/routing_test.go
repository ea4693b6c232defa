package registry

import (
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
)

// Which agent a dial goes to: one that serves the target's cluster,
// round-robin, skipping agents that drain.

func TestDialGoesToAnAgentServingTheCluster(t *testing.T) {
	r := New()
	other := newTestAgent(t, "other", "/agent/other", "other")
	serving := newTestAgent(t, "serving", "/agent/serving", "other", "root")
	r.Register(other)
	r.Register(serving)

	tgt := target("root")
	d := startDial(t, r, tgt)
	o := nextOrder(t, serving)
	if !proto.Equal(o.GetTarget(), tgt) {
		t.Errorf("order names %v, want %v", o.GetTarget(), tgt)
	}
	if o.GetTimeoutMs() != 1234 {
		t.Errorf("order gives %d ms, want the 1234 the dial was given", o.GetTimeoutMs())
	}
	noOrder(t, other)
	if !d.running() {
		t.Errorf("the dial ended before its agent answered: %v", d.wait().err)
	}
}

func TestDialWithNoAgentForTheClusterIsUnavailable(t *testing.T) {
	r := New()
	r.Register(newTestAgent(t, "a", "/agent/a", "root"))

	_, err := r.Dial(t.Context(), target("elsewhere"), 1000)
	checkStatus(t, "dial", err, codes.Unavailable, `no agent serves logical cluster "elsewhere"`)
}

func TestDialsTakeTurnsAmongTheAgentsOfACluster(t *testing.T) {
	r := New()
	a := newTestAgent(t, "a", "/agent/a", "root")
	b := newTestAgent(t, "b", "/agent/b", "root")
	r.Register(a)
	r.Register(b)

	var got []*Agent
	for range 4 {
		d := startDial(t, r, target("root"))
		to, _ := orderedTo(t, a, b)
		got = append(got, to)
		d.cancel()
		checkStatus(t, "cancelled dial", d.wait().err, codes.Canceled, "context canceled")
	}
	if got[0] == got[1] || got[0] != got[2] || got[1] != got[3] {
		t.Errorf("dials went to %v, want the two agents in turn", got)
	}
}

func TestDrainingAgentGetsNoNewDials(t *testing.T) {
	r := New()
	draining := newTestAgent(t, "draining", "/agent/draining", "root")
	staying := newTestAgent(t, "staying", "/agent/staying", "root")
	r.Register(draining)
	r.Register(staying)
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
	r := New()
	draining := newTestAgent(t, "draining", "/agent/draining", "root")
	r.Register(draining)
	draining.Drain()

	startDial(t, r, target("root"))
	nextOrder(t, draining)
}

func TestDrainingAgentGetsDialsWhenTheOthersAreAtTheirLimit(t *testing.T) {
	r := New()
	r.Limits = Limits{MaxPendingPerAgent: 1}
	draining := newTestAgent(t, "draining", "/agent/draining", "root")
	busy := newTestAgent(t, "busy", "/agent/busy", "root")
	r.Register(draining)
	r.Register(busy)
	draining.Drain()

	startDial(t, r, target("root"))
	nextOrder(t, busy) // busy is at its limit of one pending dial now
	startDial(t, r, target("root"))
	nextOrder(t, draining)
}

func TestUnregisteredAgentGetsNoDials(t *testing.T) {
	r := New()
	a := newTestAgent(t, "a", "/agent/a", "root")
	r.Register(a)
	r.Unregister(a)

	_, err := r.Dial(t.Context(), target("root"), 1000)
	checkStatus(t, "dial", err, codes.Unavailable, `no agent serves logical cluster "root"`)
	noOrder(t, a)
}

func TestUnregisterLeavesTheOtherAgentsOfTheCluster(t *testing.T) {
	r := New()
	leaving := newTestAgent(t, "leaving", "/agent/leaving", "root")
	staying := newTestAgent(t, "staying", "/agent/staying", "root")
	r.Register(leaving)
	r.Register(staying)
	r.Unregister(leaving)

	for range 2 {
		startDial(t, r, target("root"))
		nextOrder(t, staying)
	}
	noOrder(t, leaving)
}

func TestUpdateRoutesTheNewClustersAndNotTheOldOnes(t *testing.T) {
	r := New()
	a := newTestAgent(t, "a", "/agent/a", "old", "kept")
	r.Register(a)
	r.Update(a, []string{"kept", "new"})

	_, err := r.Dial(t.Context(), target("old"), 1000)
	checkStatus(t, "dial to a cluster the agent no longer serves", err, codes.Unavailable, `no agent serves logical cluster "old"`)
	for _, c := range []string{"kept", "new"} {
		startDial(t, r, target(c))
		if o := nextOrder(t, a); o.GetTarget().GetCluster() != c {
			t.Errorf("order for cluster %q, want %q", o.GetTarget().GetCluster(), c)
		}
	}
}

func TestUpdateLetsDialsAlreadyOrderedFinish(t *testing.T) {
	r := New()
	a := newTestAgent(t, "a", "/agent/a", "old")
	r.Register(a)
	d := startDial(t, r, target("old"))
	o := nextOrder(t, a)

	r.Update(a, []string{"new"})
	stream := newFakeTunnelStream()
	if _, err := r.Claim(o.GetDialId(), a.ID, stream); err != nil {
		t.Fatalf("claim of a dial ordered before the update: %v", err)
	}
	out := d.wait()
	if out.err != nil || out.tunnel == nil || out.tunnel.Stream != stream {
		t.Fatalf("dial: %v, tunnel %v; want the claimed tunnel", out.err, out.tunnel)
	}
	out.tunnel.Finish(nil)
}
