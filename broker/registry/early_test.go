package registry

import (
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// A dial's early data goes in its order only to an agent that said it
// accepts early data; the claim says whether it did, so that the tunnel
// sends it otherwise.

// registerEarlyAgent registers an agent, as registerAgent does, that
// accepts early data.
func registerEarlyAgent(t *testing.T, r *Registry, name string, clusters ...string) *Agent {
	t.Helper()
	a := newTestAgent(t, name, "/agent/"+name, clusters...)
	a.AcceptsEarlyData = true
	r.Register(a)
	return a
}

func TestEarlyDataGoesInTheOrderOnlyToAnAgentThatAcceptsIt(t *testing.T) {
	for _, accepts := range []bool{true, false} {
		r := New(Limits{})
		a := newTestAgent(t, "a", "/agent/a", "root")
		a.AcceptsEarlyData = accepts
		r.Register(a)
		d := startDialWith(t, r, target("root"), []byte("client hello"))
		o := nextOrder(t, a)
		if got, want := string(o.GetEarlyData()), map[bool]string{true: "client hello", false: ""}[accepts]; got != want {
			t.Errorf("accepts early data %v: the order carries %q, want %q", accepts, got, want)
		}
		claim(t, "claim", r, o.GetDialId(), a.ID)
		if got := d.connected().EarlyDataOrdered; got != accepts {
			t.Errorf("accepts early data %v: EarlyDataOrdered = %v", accepts, got)
		}
	}
}

// earlyDialToTwoAgents dials root with early data, served by two agents
// that accept it, and returns the agent its order went to, the order, and
// the other agent.
func earlyDialToTwoAgents(t *testing.T, r *Registry) (d *dialing, first *Agent, o *tunnelv1.DialOrder, other *Agent) {
	t.Helper()
	a := registerEarlyAgent(t, r, "a", "root")
	b := registerEarlyAgent(t, r, "b", "root")
	d = startDialWith(t, r, target("root"), []byte("client hello"))
	first, o = orderedTo(t, a, b)
	return d, first, o, map[*Agent]*Agent{a: b, b: a}[first]
}

func TestADialWhoseEarlyDataReachedATargetIsNotRetriedOnAnotherAgent(t *testing.T) {
	r := New(Limits{})
	d, first, o, other := earlyDialToTwoAgents(t, r)
	r.Fail(first, &tunnelv1.DialFailure{DialId: o.GetDialId(), Code: int32(codes.Unavailable),
		Message: "the tunnel failed as it opened: connection reset by peer", EarlyDataSent: true})
	testutil.CheckStatus(t, "Dial", d.wait().err, codes.Unavailable, "connection reset by peer")
	noOrder(t, other)
}

func TestADialWhoseEarlyDataDidNotReachATargetIsRetried(t *testing.T) {
	r := New(Limits{})
	d, first, o, other := earlyDialToTwoAgents(t, r)
	failOrder(r, first, o, codes.Unavailable, "connection refused")
	retry := nextOrder(t, other)
	if got := string(retry.GetEarlyData()); got != "client hello" {
		t.Errorf("the retry carries %q, want the early data again", got)
	}
	claim(t, "the retry's claim", r, retry.GetDialId(), other.ID)
	d.connected()
}
