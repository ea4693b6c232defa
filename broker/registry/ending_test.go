package registry

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/internal/testutil"
)

// How a dial ends without the agent's answer, and what becomes of a tunnel
// the agent opens for a dial nobody waits for any more.

func TestDialEndsWhenTheAgentGoes(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")
	d, o := orderedDial(t, r, "root", a)

	r.Unregister(a)
	testutil.CheckStatus(t, "dial", d.wait().err, codes.Unavailable, "agent a went away"+inTunnel(o.GetDialId()))
	_, err := r.Claim(o.GetDialId(), a.ID)
	if status.Code(err) != codes.NotFound {
		t.Errorf("claim after the dial ended: %v, want NotFound", err)
	}
}

func TestDialEndsWhenTheAgentGoesBeforeTakingItsOrder(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")
	d, id := queuedDial(t, r, "root", a)

	r.Unregister(a)
	testutil.CheckStatus(t, "dial", d.wait().err, codes.Unavailable, "agent a went away"+inTunnel(id))
}

func TestDialTimesOutWhenTheAgentDoesNotConnect(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Millisecond)
	defer cancel()

	_, err := r.Dial(ctx, target("root"), nil)
	testutil.CheckStatus(t, "dial", err, codes.DeadlineExceeded, "agent a did not connect in time"+inTunnel(nextOrder(t, a).GetDialId()))
}

func TestCancelledDialIsCanceled(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")
	d, _ := orderedDial(t, r, "root", a)

	d.cancel()
	testutil.CheckStatus(t, "dial", d.wait().err, codes.Canceled, "context canceled")
}

func TestClaimAfterTheDialGaveUpIsRefused(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")
	d, o := orderedDial(t, r, "root", a)
	d.cancel()
	d.wait()

	checkClaimRefused(t, "late claim", r, o.GetDialId(), a.ID)
	if n := a.Tunnels(); n != 0 {
		t.Errorf("a late claim left the agent with %d tunnels", n)
	}
}

// The dial below is claimed while its order still waits for room in the
// agent's queue, so the dial gives up with the claim made and its tunnel
// handed over: the registry must end that tunnel itself.

func TestAnAbandonedClaimEndsItsTunnel(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")
	d, id := queuedDial(t, r, "root", a)
	tun := claim(t, "claim", r, id, a.ID)

	d.cancel()
	out := d.wait()
	testutil.CheckStatus(t, "dial", out.err, codes.Canceled, "context canceled")
	if out.claim != nil {
		t.Error("a cancelled dial returned a tunnel")
	}
	testutil.CheckStatus(t, "the abandoned tunnel", tun.waitEnded(t), codes.Canceled, "context canceled")
	if n := a.Tunnels(); n != 0 {
		t.Errorf("the agent carries %d tunnels after the abandoned one ended, want 0", n)
	}
}

func TestAClaimedDialWhoseAgentGoesEndsItsTunnel(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")
	d, id := queuedDial(t, r, "root", a)
	tun := claim(t, "claim", r, id, a.ID)

	r.Unregister(a)
	out := d.wait()
	testutil.CheckStatus(t, "dial", out.err, codes.Unavailable, "agent a went away"+inTunnel(id))
	if out.claim != nil {
		t.Error("a dial whose agent went away returned a tunnel")
	}
	testutil.CheckStatus(t, "the abandoned tunnel", tun.waitEnded(t), codes.Unavailable, "agent a went away"+inTunnel(id))
	if n := a.Tunnels(); n != 0 {
		t.Errorf("the agent carries %d tunnels after the abandoned one ended, want 0", n)
	}
}

// TestDialThatEndsAsItIsClaimedLeavesNoTunnelOpen races a claim against the
// end of the dial: whichever wins, the tunnel is either the dial's to end
// or already ended with the dial's status.
func TestDialThatEndsAsItIsClaimedLeavesNoTunnelOpen(t *testing.T) {
	for i := range 50 {
		r := New(Limits{})
		a := registerAgent(t, r, "a", "root")
		d, o := orderedDial(t, r, "root", a)
		claimed := make(chan *fakeTunnel, 1)
		go func() {
			c, err := r.Claim(o.GetDialId(), a.ID)
			if err != nil {
				claimed <- nil
				return
			}
			tun := newFakeTunnel()
			c.HandOver(tun)
			claimed <- tun
		}()
		if i%2 == 0 {
			d.cancel()
		} else {
			r.Unregister(a)
		}
		out := d.wait()
		tun := <-claimed
		switch {
		case out.err == nil:
			if tun == nil || out.claim.Tunnel() != tun {
				t.Fatalf("round %d: the dial returned a tunnel that was not claimed", i)
			}
			out.claim.Release()
		case tun != nil:
			if err := tun.waitEnded(t); status.Code(err) != status.Code(out.err) {
				t.Errorf("round %d: the claimed tunnel ended with %v, the dial with %v", i, err, out.err)
			}
		}
		if n := a.Tunnels(); n != 0 {
			t.Fatalf("round %d: the agent carries %d tunnels, want 0", i, n)
		}
	}
}

// queuedDial starts a dial to cluster whose order waits for room in a's
// queue, which it fills first, and returns the dial and its id.
func queuedDial(t *testing.T, r *Registry, cluster string, a *Agent) (*dialing, uint64) {
	t.Helper()
	fillOrders(a)
	d := startDial(t, r, target(cluster))
	return d, waitPending(t, r, a, 1)[0]
}

// fillOrders fills a's order queue, as an agent that reads no orders would
// let it fill: the next dial's order waits for room.
func fillOrders(a *Agent) {
	for len(a.orders) < cap(a.orders) {
		a.orders <- nil
	}
}

// waitPending waits until n dials wait on a, and returns their ids. It polls:
// a dial that waits for room in the agent's queue shows nowhere else.
func waitPending(t *testing.T, r *Registry, a *Agent, n int) []uint64 {
	t.Helper()
	deadline := time.Now().Add(waitLong)
	for {
		r.mu.Lock()
		var ids []uint64
		for id, p := range r.pending {
			if p.agent == a {
				ids = append(ids, id)
			}
		}
		r.mu.Unlock()
		if len(ids) == n {
			return ids
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d dials pending on %s after %v, want %d", len(ids), a, waitLong, n)
		}
		time.Sleep(time.Millisecond)
	}
}
