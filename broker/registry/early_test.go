package registry

import (
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// A dial's early data goes in its order: the agent writes it to the target
// before anything the tunnel carries.

// registerEarlyAgent registers an agent, as registerAgent does.
func registerEarlyAgent(t *testing.T, r *Registry, name string, clusters ...string) *Agent {
	t.Helper()
	a := newTestAgent(t, name, "/agent/"+name, clusters...)
	r.Register(a)
	return a
}

func TestEarlyDataGoesInTheOrder(t *testing.T) {
	r := New(Limits{})
	a := registerEarlyAgent(t, r, "a", "root")
	d := startDialWith(t, r, target("root"), []byte("client hello"))
	o := nextOrder(t, a)
	if got := string(o.GetEarlyData()); got != "client hello" {
		t.Errorf("the order carries %q, want the early data", got)
	}
	claim(t, "claim", r, o.GetDialId(), a.ID)
	d.connected()
}

func TestAnOrderWithoutEarlyDataCarriesNone(t *testing.T) {
	r := New(Limits{})
	a := registerEarlyAgent(t, r, "a", "root")
	startDialWith(t, r, target("root"), nil)
	if o := nextOrder(t, a); len(o.GetEarlyData()) != 0 {
		t.Errorf("the order carries %q, want no early data", o.GetEarlyData())
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
