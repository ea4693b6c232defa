package registry

import (
	"context"
	"errors"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// What one agent may be asked to carry: Limits.

func TestPendingDialsPerClusterAreBounded(t *testing.T) {
	r := New(Limits{MaxPendingPerCluster: 2})
	a := registerAgent(t, r, "a", "root")
	for range 2 {
		orderedDial(t, r, "root", a)
	}

	_, err := r.Dial(t.Context(), target("root"), nil)
	testutil.CheckStatus(t, "dial past the limit", err, codes.ResourceExhausted, `every agent of logical cluster "root" has 2 of its dials pending`)
	checkLimit(t, err, LimitPendingPerCluster)
	noOrder(t, a)
}

// A cluster whose targets hang fills its own queue of pending dials on the
// agent, and no other cluster's: the agent still takes the others' dials.
func TestOneClustersPendingDialsDoNotCountAgainstAnothers(t *testing.T) {
	r := New(Limits{MaxPendingPerCluster: 2})
	a := registerAgent(t, r, "a", "hanging", "healthy")
	for range 2 {
		orderedDial(t, r, "hanging", a)
	}
	_, err := r.Dial(t.Context(), target("hanging"), nil)
	checkLimit(t, err, LimitPendingPerCluster)

	for range 2 {
		orderedDial(t, r, "healthy", a)
	}
}

// Pending dials count against the tunnel limit for their own cluster only:
// another cluster's hanging dials leave the agent's tunnels to the rest.
func TestOtherClustersPendingDialsDoNotCountAgainstTheTunnelLimit(t *testing.T) {
	r := New(Limits{MaxTunnelsPerAgent: 2})
	a := registerAgent(t, r, "a", "hanging", "healthy")
	for range 2 {
		orderedDial(t, r, "hanging", a)
	}
	_, err := r.Dial(t.Context(), target("hanging"), nil)
	checkLimit(t, err, LimitTunnelsPerAgent)

	claimedTunnel(t, r, "healthy", a)
}

func TestAnsweredDialFreesItsPendingPlace(t *testing.T) {
	r := New(Limits{MaxPendingPerCluster: 1})
	a := registerAgent(t, r, "a", "root")
	d, o := orderedDial(t, r, "root", a)
	r.Fail(a, &tunnelv1.DialFailure{DialId: o.GetDialId(), Code: int32(codes.NotFound), Message: "no such service"})
	d.wait()

	startDial(t, r, target("root"))
	nextOrder(t, a)
}

func TestGivenUpDialFreesItsPendingPlace(t *testing.T) {
	r := New(Limits{MaxPendingPerCluster: 1})
	a := registerAgent(t, r, "a", "root")
	d, _ := orderedDial(t, r, "root", a)
	d.cancel()
	d.wait()

	startDial(t, r, target("root"))
	nextOrder(t, a)
}

func TestTunnelsPerAgentAreBounded(t *testing.T) {
	r := New(Limits{MaxTunnelsPerAgent: 1})
	a := registerAgent(t, r, "a", "root")
	tun := claimedTunnel(t, r, "root", a)

	_, err := r.Dial(t.Context(), target("root"), nil)
	testutil.CheckStatus(t, "dial past the limit", err, codes.ResourceExhausted, `every agent of logical cluster "root" carries 1 tunnels`)
	checkLimit(t, err, LimitTunnelsPerAgent)
	noOrder(t, a)

	// A tunnel that ended frees its place.
	tun.Release()
	startDial(t, r, target("root"))
	nextOrder(t, a)
}

// Dials on their way to becoming tunnels count against the tunnel limit
// too: otherwise dials that arrive together all pass it.
func TestDialsInFlightCountAgainstTheTunnelLimit(t *testing.T) {
	r := New(Limits{MaxTunnelsPerAgent: 1})
	a := registerAgent(t, r, "a", "root")
	orderedDial(t, r, "root", a)

	// Bounded: a dial wrongly let through would wait for the agent.
	ctx, cancel := context.WithTimeout(t.Context(), waitLong)
	defer cancel()
	_, err := r.Dial(ctx, target("root"), nil)
	testutil.CheckStatus(t, "dial past the limit", err, codes.ResourceExhausted, `every agent of logical cluster "root" carries 1 tunnels`)
	noOrder(t, a)
}

func TestDialGoesToAnotherAgentWhenOneIsAtItsLimit(t *testing.T) {
	r := New(Limits{MaxPendingPerCluster: 1})
	a := registerAgent(t, r, "a", "root")
	b := registerAgent(t, r, "b", "root")
	startDial(t, r, target("root"))
	full, _ := orderedTo(t, a, b)
	free := a
	if full == a {
		free = b
	}

	// The round-robin turn would be free's anyway; the next one, full's,
	// goes to free too.
	for range 2 {
		d := startDial(t, r, target("root"))
		if to, _ := orderedTo(t, a, b); to != free {
			t.Fatalf("dial went to %s, which is at its limit", to)
		}
		d.cancel()
		d.wait()
	}
}

func TestLimitsCountPerAgent(t *testing.T) {
	// One agent's dials do not count against another's limit.
	r := New(Limits{MaxPendingPerCluster: 1})
	a := registerAgent(t, r, "a", "root")
	b := registerAgent(t, r, "b", "other")
	orderedDial(t, r, "root", a)

	startDial(t, r, target("other"))
	nextOrder(t, b)
}

func TestNegativeLimitsBoundNothing(t *testing.T) {
	r := New(Limits{MaxPendingPerCluster: -1, MaxTunnelsPerAgent: -1})
	a := registerAgent(t, r, "a", "root")
	for range 3 {
		claimedTunnel(t, r, "root", a)
	}
	for range 3 {
		orderedDial(t, r, "root", a)
	}
	if n := a.Tunnels(); n != 3 {
		t.Errorf("agent carries %d tunnels, want 3", n)
	}
}

func TestZeroLimitsAreTheDefaults(t *testing.T) {
	want := Limits{MaxPendingPerCluster: DefaultMaxPendingPerCluster, MaxTunnelsPerAgent: DefaultMaxTunnelsPerAgent}
	if got := New(Limits{}).limits; got != want {
		t.Errorf("limits %+v, want %+v", got, want)
	}
}

// checkLimit checks that err is a refusal by limit.
func checkLimit(t *testing.T, err error, limit string) {
	t.Helper()
	var l *LimitError
	if !errors.As(err, &l) {
		t.Errorf("got %v, want a refusal by limit %s", err, limit)
		return
	}
	if l.Limit != limit {
		t.Errorf("refused by limit %s, want %s", l.Limit, limit)
	}
}
