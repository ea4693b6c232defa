package registry

import (
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// HA agents: a dial that one agent of its cluster fails before any byte
// flows, with Unavailable, is ordered once more to another.

func failOrder(r *Registry, a *Agent, o *tunnelv1.DialOrder, code codes.Code, msg string) {
	r.Fail(a, &tunnelv1.DialFailure{DialId: o.GetDialId(), Code: int32(code), Message: msg})
}

func TestADialFailedByOneAgentIsRetriedOnAnother(t *testing.T) {
	for _, tc := range []struct {
		name string
		fail func(r *Registry, a *Agent, o *tunnelv1.DialOrder)
	}{
		{"target refused", func(r *Registry, a *Agent, o *tunnelv1.DialOrder) {
			failOrder(r, a, o, codes.Unavailable, "connection refused")
		}},
		{"agent draining", func(r *Registry, a *Agent, o *tunnelv1.DialOrder) {
			a.Drain()
			failOrder(r, a, o, codes.Unavailable, "the agent is draining")
		}},
		{"agent gone", func(r *Registry, a *Agent, _ *tunnelv1.DialOrder) { r.Unregister(a) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := New(Limits{})
			a := registerAgent(t, r, "a", "root")
			b := registerAgent(t, r, "b", "root")
			d := startDial(t, r, target("root"))
			first, o := orderedTo(t, a, b)
			other := map[*Agent]*Agent{a: b, b: a}[first]
			tc.fail(r, first, o)
			retry := nextOrder(t, other)
			if retry.GetDialId() == o.GetDialId() {
				t.Error("the retry has the first order's dial id")
			}
			tun := claim(t, "the retry's claim", r, retry.GetDialId(), other.ID)
			if c := d.connected(); c.Tunnel() != tun || c.Agent != other {
				t.Errorf("the dial got a tunnel through %s, want the retry's through %s", c.Agent, other)
			}
			noOrder(t, first)
		})
	}
}

// failedOnce is a dial in root, which has two agents, that the agent it
// was ordered to first failed with Unavailable "refused once" (order o1):
// the registry orders it again to second.
func failedOnce(t *testing.T) (r *Registry, d *dialing, first, second *Agent, o1 *tunnelv1.DialOrder) {
	t.Helper()
	r = New(Limits{})
	a := registerAgent(t, r, "a", "root")
	b := registerAgent(t, r, "b", "root")
	d = startDial(t, r, target("root"))
	first, o1 = orderedTo(t, a, b)
	failOrder(r, first, o1, codes.Unavailable, "refused once")
	return r, d, first, map[*Agent]*Agent{a: b, b: a}[first], o1
}

func TestADialThatEveryAgentFailsReturnsOneErrorNamingBoth(t *testing.T) {
	r, d, first, second, o1 := failedOnce(t)
	o2 := nextOrder(t, second)
	failOrder(r, second, o2, codes.Unavailable, "refused twice")
	err := d.wait().err
	testutil.CheckStatus(t, "dial", err, codes.Unavailable, "agent "+second.Name+": refused twice"+inTunnel(o2.GetDialId())+
		"; before it, agent "+first.Name+": refused once"+inTunnel(o1.GetDialId()))
	noOrder(t, first)
	noOrder(t, second)
}

func TestADialIsOrderedAtMostTwice(t *testing.T) {
	r := New(Limits{})
	agents := []*Agent{registerAgent(t, r, "a", "root"), registerAgent(t, r, "b", "root"), registerAgent(t, r, "c", "root")}
	d := startDial(t, r, target("root"))
	for range 2 {
		to, o := orderedTo(t, agents[0], agents[1], agents[2])
		failOrder(r, to, o, codes.Unavailable, "refused")
	}
	if out := d.wait(); out.err == nil {
		t.Fatal("the dial succeeded")
	}
	for _, a := range agents {
		noOrder(t, a)
	}
}

func TestADialIsNotRetriedWhenNoOtherAgentServesTheCluster(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")
	d := startDial(t, r, target("root"))
	o := nextOrder(t, a)
	failOrder(r, a, o, codes.Unavailable, "refused")
	testutil.CheckStatus(t, "dial", d.wait().err, codes.Unavailable, "agent a: refused"+inTunnel(o.GetDialId()))
	noOrder(t, a)
}

func TestADialFailedForAnotherReasonIsNotRetried(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")
	b := registerAgent(t, r, "b", "root")
	d := startDial(t, r, target("root"))
	first, o := orderedTo(t, a, b)
	failOrder(r, first, o, codes.NotFound, "no such Service")
	testutil.CheckStatus(t, "dial", d.wait().err, codes.NotFound, "agent "+first.Name+": no such Service"+inTunnel(o.GetDialId()))
	noOrder(t, a)
	noOrder(t, b)
}
