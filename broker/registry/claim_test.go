package registry

import (
	"fmt"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// How an agent answers a dial order: it claims the dial with a Tunnel
// stream, or reports a failure on its control stream.

func TestClaimHandsTheTunnelToTheDial(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")
	tgt := target("root")
	d := startDial(t, r, tgt)
	o := nextOrder(t, a)

	c, err := r.Claim(o.GetDialId(), a.ID)
	if err != nil {
		t.Fatalf("claim: %v", err)
	}
	tun := newFakeTunnel()
	c.HandOver(tun)
	got := d.connected()
	if got != c || got.Tunnel() != tun {
		t.Fatal("the dial got another claim or tunnel than the claim handed over")
	}
	if got.Agent != a || got.Target != tgt {
		t.Errorf("claim of agent %s, target %v; want agent %s, target %v", got.Agent, got.Target, a, tgt)
	}
	if want := fmt.Sprintf("%016x", o.GetDialId()); got.TunnelID != want {
		t.Errorf("tunnel ID %q, want the dial id in hex, %q", got.TunnelID, want)
	}
	got.Release()
}

func TestAClaimedTunnelCountsAgainstItsAgentUntilReleasedOnce(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")
	b := registerAgent(t, r, "b", "other")
	first := claimedTunnel(t, r, "root", a)
	claimedTunnel(t, r, "root", a)
	if n, m := a.Tunnels(), b.Tunnels(); n != 2 || m != 0 {
		t.Fatalf("agents carry %d and %d tunnels, want 2 and 0", n, m)
	}
	first.Release()
	first.Release()
	if n := a.Tunnels(); n != 1 {
		t.Errorf("agent carries %d tunnels after one of two was released twice, want 1", n)
	}
}

func TestTunnelsOutliveTheirAgentsRegistration(t *testing.T) {
	// An established tunnel has streams of its own: the agent's Connect
	// ending does not end it.
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")
	d, o := orderedDial(t, r, "root", a)
	tun := claim(t, "claim", r, o.GetDialId(), a.ID)
	c := d.connected()

	r.Unregister(a)
	select {
	case err := <-tun.ended:
		t.Errorf("the tunnel ended with %v when its agent unregistered", err)
	default:
	}
	if n := a.Tunnels(); n != 1 {
		t.Errorf("agent carries %d tunnels, want 1", n)
	}
	c.Release()
}

func TestClaimByAnotherAgentIsRefused(t *testing.T) {
	r := New(Limits{})
	ordered := registerAgent(t, r, "ordered", "root")
	intruder := registerAgent(t, r, "intruder", "root")
	d := startDial(t, r, target("root"))
	to, o := orderedTo(t, ordered, intruder)
	if to != ordered {
		ordered, intruder = intruder, ordered
	}
	noOrder(t, intruder)

	checkClaimRefused(t, "claim by another agent", r, o.GetDialId(), intruder.ID)
	if !d.running() {
		t.Fatalf("the refused claim ended the dial: %v", d.wait().err)
	}
	// The dial still waits for the agent it was ordered to.
	claim(t, "claim by the ordered agent after a refused one", r, o.GetDialId(), ordered.ID)
	d.connected()
}

func TestAnotherSessionOfTheAgentMayClaim(t *testing.T) {
	// A dial id belongs to the agent's SPIFFE ID, not to one control
	// stream: its Tunnel stream is a separate RPC.
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")
	sameID := NewAgent("another-session", a.ID, "a", nil)
	d, o := orderedDial(t, r, "root", a)

	claim(t, "claim with the ordered agent's SPIFFE ID", r, o.GetDialId(), sameID.ID)
	d.connected()
}

func TestClaimOfAnUnknownDialIsRefused(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")

	checkClaimRefused(t, "claim", r, 42, a.ID)
	if n := a.Tunnels(); n != 0 {
		t.Errorf("a refused claim left the agent with %d tunnels", n)
	}
}

func TestSecondClaimOfADialIsRefused(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")
	d, o := orderedDial(t, r, "root", a)
	claim(t, "first claim", r, o.GetDialId(), a.ID)

	checkClaimRefused(t, "second claim", r, o.GetDialId(), a.ID)
	if n := a.Tunnels(); n != 1 {
		t.Errorf("agent carries %d tunnels after two claims of one dial, want 1", n)
	}
	d.connected().Release()
}

func TestDialIDsAreNotReused(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")
	seen := map[uint64]bool{}
	for range 5 {
		d, o := orderedDial(t, r, "root", a)
		if seen[o.GetDialId()] {
			t.Errorf("dial id %d given twice", o.GetDialId())
		}
		seen[o.GetDialId()] = true
		d.cancel()
		d.wait()
	}
}

func TestDialIDsOfTwoRegistriesDiffer(t *testing.T) {
	// Dial ids start at a random point, so that an agent's late open for a
	// dial of an earlier incarnation of the replica is unlikely to match.
	first := func() uint64 {
		r := New(Limits{})
		a := registerAgent(t, r, "a", "root")
		d, o := orderedDial(t, r, "root", a)
		d.cancel()
		d.wait()
		return o.GetDialId()
	}
	if x, y := first(), first(); x == y {
		t.Errorf("two registries both started with dial id %d", x)
	}
}

func TestFailureEndsTheDialWithTheAgentsCode(t *testing.T) {
	for _, tc := range []struct {
		reported, want codes.Code
	}{
		// Codes a caller can act on pass through.
		{codes.NotFound, codes.NotFound},
		{codes.Unavailable, codes.Unavailable},
		{codes.DeadlineExceeded, codes.DeadlineExceeded},
		{codes.PermissionDenied, codes.PermissionDenied},
		{codes.ResourceExhausted, codes.ResourceExhausted},
		{codes.InvalidArgument, codes.InvalidArgument},
		{codes.FailedPrecondition, codes.FailedPrecondition},
		// Anything else means the agent failed.
		{codes.OK, codes.Unavailable},
		{codes.Internal, codes.Unavailable},
		{codes.Unknown, codes.Unavailable},
		{codes.Canceled, codes.Unavailable},
		{codes.Unauthenticated, codes.Unavailable},
		{codes.Code(99), codes.Unavailable},
	} {
		t.Run(tc.reported.String(), func(t *testing.T) {
			r := New(Limits{})
			// A name other than its SPIFFE ID's path: the caller sees the name.
			a := newTestAgent(t, "sync-target-1", "/agent/a", "root")
			r.Register(a)
			d, o := orderedDial(t, r, "root", a)

			r.Fail(a, &tunnelv1.DialFailure{DialId: o.GetDialId(), Code: int32(tc.reported), Message: "connection refused"})
			out := d.wait()
			testutil.CheckStatus(t, "dial", out.err, tc.want, "agent sync-target-1: connection refused"+inTunnel(o.GetDialId()))
			if out.claim != nil {
				t.Error("a failed dial returned a tunnel")
			}
		})
	}
}

func TestFailureFromAnotherSessionIsIgnored(t *testing.T) {
	// A dial_failure counts only on the control stream the order went on,
	// even from the same SPIFFE ID.
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")
	sameID := NewAgent("another-session", a.ID, "a", []string{"root"})
	d, o := orderedDial(t, r, "root", a)

	r.Fail(sameID, &tunnelv1.DialFailure{DialId: o.GetDialId(), Code: int32(codes.NotFound), Message: "no such service"})
	if !d.running() {
		t.Fatalf("a failure from another session ended the dial: %v", d.wait().err)
	}
	claim(t, "claim after an ignored failure", r, o.GetDialId(), a.ID)
	d.connected()
}

func TestFailureAfterClaimIsIgnored(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")
	d, o := orderedDial(t, r, "root", a)
	claim(t, "claim", r, o.GetDialId(), a.ID)

	r.Fail(a, &tunnelv1.DialFailure{DialId: o.GetDialId(), Code: int32(codes.Unavailable), Message: "reset"})
	out := d.wait()
	if out.err != nil || out.claim == nil {
		t.Fatalf("dial: %v, claim %v; want the claim", out.err, out.claim)
	}
}

func TestFailureOfAnUnknownDialIsIgnored(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")
	d, o := orderedDial(t, r, "root", a)

	r.Fail(a, &tunnelv1.DialFailure{DialId: o.GetDialId() + 1000, Code: int32(codes.NotFound)})
	if !d.running() {
		t.Fatalf("a failure of another dial ended this one: %v", d.wait().err)
	}
	claim(t, "claim after a failure of another dial", r, o.GetDialId(), a.ID)
	d.connected()
}
