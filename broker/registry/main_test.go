package registry

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"

	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// This file holds what the registry's tests share: agents, dials run in the
// background, and a stand-in for the tunnel an agent's Tunnel RPC hands over.

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// waitLong bounds every "this eventually happens" in the tests. It is far
// above anything a healthy run needs, so hitting it means a hang.
const waitLong = 10 * time.Second

// newTestAgent is an agent of the test trust domain, with path as its
// SPIFFE ID's path.
func newTestAgent(t *testing.T, name, path string, clusters ...string) *Agent {
	t.Helper()
	id, err := spiffeid.FromPath(spiffeid.RequireTrustDomainFromString("example.org"), path)
	if err != nil {
		t.Fatal(err)
	}
	return NewAgent("session-"+name, id, name, clusters)
}

// registerAgent registers an agent named name, of SPIFFE ID path
// /agent/<name>, serving clusters.
func registerAgent(t *testing.T, r *Registry, name string, clusters ...string) *Agent {
	t.Helper()
	a := newTestAgent(t, name, "/agent/"+name, clusters...)
	r.Register(a)
	return a
}

// target is a valid target in cluster.
func target(cluster string) *tunnelv1.Target {
	return &tunnelv1.Target{Cluster: cluster, Namespace: "default", Service: "webhook", Port: 443}
}

// outcome is what a Dial returned.
type outcome struct {
	claim *Claim
	err   error
}

// dialing is a Dial running in the background.
type dialing struct {
	t      *testing.T
	cancel context.CancelFunc
	done   chan struct{} // closed when out is set
	out    outcome
}

// dialTimeout is the deadline of the tests' dials: long enough that only a
// hang reaches it.
const dialTimeout = 2 * waitLong

// startDial runs r.Dial in the background with a context the test cancels
// through the returned dialing, or that ends when the test does.
func startDial(t *testing.T, r *Registry, tgt *tunnelv1.Target) *dialing {
	t.Helper()
	return startDialWith(t, r, tgt, nil)
}

// startDialWith is startDial of a dial that carries earlyData.
func startDialWith(t *testing.T, r *Registry, tgt *tunnelv1.Target, earlyData []byte) *dialing {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), dialTimeout)
	d := &dialing{t: t, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(d.done)
		d.out.claim, d.out.err = r.Dial(ctx, tgt, earlyData)
	}()
	// A failed test must not leave the dial running for goleak to find, nor
	// a tunnel open.
	t.Cleanup(func() {
		cancel()
		select {
		case <-d.done:
			if d.out.claim != nil {
				d.out.claim.Release()
			}
		case <-time.After(waitLong):
			t.Errorf("a dial did not end within %v of its cancellation", waitLong)
		}
	})
	return d
}

// wait is the dial's outcome.
func (d *dialing) wait() outcome {
	d.t.Helper()
	select {
	case <-d.done:
		return d.out
	case <-time.After(waitLong):
		d.t.Fatalf("the dial did not end within %v", waitLong)
		return outcome{}
	}
}

// connected is the claim the dial got; a failed dial fails the test.
func (d *dialing) connected() *Claim {
	d.t.Helper()
	out := d.wait()
	if out.err != nil {
		d.t.Fatalf("dial: %v", out.err)
	}
	return out.claim
}

// running checks that the dial has not ended.
func (d *dialing) running() bool {
	select {
	case <-d.done:
		return false
	default:
		return true
	}
}

// nextOrder is the next order the agent is given.
func nextOrder(t *testing.T, a *Agent) *tunnelv1.DialOrder {
	t.Helper()
	select {
	case o := <-a.Orders():
		return o
	case <-time.After(waitLong):
		t.Fatalf("agent %s got no order within %v", a, waitLong)
		return nil
	}
}

// orderedTo waits for the next order given to one of agents and says which
// of them got it.
func orderedTo(t *testing.T, agents ...*Agent) (*Agent, *tunnelv1.DialOrder) {
	t.Helper()
	deadline := time.After(waitLong)
	for {
		for _, a := range agents {
			select {
			case o := <-a.Orders():
				return a, o
			default:
			}
		}
		select {
		case <-deadline:
			t.Fatalf("none of %v got an order within %v", agents, waitLong)
			return nil, nil
		case <-time.After(time.Millisecond):
		}
	}
}

// noOrder checks that a has no order waiting.
func noOrder(t *testing.T, a *Agent) {
	t.Helper()
	select {
	case o := <-a.Orders():
		t.Errorf("agent %s was ordered dial %d, want no order", a, o.GetDialId())
	default:
	}
}

// orderedDial starts a dial to cluster and waits for a's order for it: a dial
// in flight, that a has yet to answer.
func orderedDial(t *testing.T, r *Registry, cluster string, a *Agent) (*dialing, *tunnelv1.DialOrder) {
	t.Helper()
	d := startDial(t, r, target(cluster))
	return d, nextOrder(t, a)
}

// claim claims dial dialID for the agent of SPIFFE ID agentID and hands over
// a stand-in for its tunnel, which it returns; a refused claim fails the
// test, what naming it.
func claim(t *testing.T, what string, r *Registry, dialID uint64, agentID spiffeid.ID) *fakeTunnel {
	t.Helper()
	c, err := r.Claim(dialID, agentID)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	tun := newFakeTunnel()
	c.HandOver(tun)
	return tun
}

// claimedTunnel is a claim of a dial through a to cluster, as the dial gets
// it.
func claimedTunnel(t *testing.T, r *Registry, cluster string, a *Agent) *Claim {
	t.Helper()
	d, o := orderedDial(t, r, cluster, a)
	claim(t, "claim", r, o.GetDialId(), a.ID)
	return d.connected()
}

// checkClaimRefused checks that a claim of dial dialID by the agent of SPIFFE
// ID agentID is refused as NotFound.
func checkClaimRefused(t *testing.T, what string, r *Registry, dialID uint64, agentID spiffeid.ID) {
	t.Helper()
	_, err := r.Claim(dialID, agentID)
	testutil.CheckStatus(t, what, err, codes.NotFound,
		fmt.Sprintf("no pending dial %d for %s (it timed out or was cancelled)", dialID, agentID))
}

// inTunnel ends the message of a dial that failed after its order: the
// tunnel id under which the broker logs it.
func inTunnel(dialID uint64) string { return fmt.Sprintf(" (tunnel %016x)", dialID) }

// fakeTunnel stands in for the tunnel an agent's Tunnel RPC hands over: the
// registry only passes it on, or ends it.
type fakeTunnel struct{ ended chan error }

func newFakeTunnel() *fakeTunnel { return &fakeTunnel{ended: make(chan error, 1)} }

// End records the first end.
func (f *fakeTunnel) End(err error) {
	select {
	case f.ended <- err:
	default:
	}
}

// waitEnded is the status the tunnel was ended with.
func (f *fakeTunnel) waitEnded(t *testing.T) error {
	t.Helper()
	select {
	case err := <-f.ended:
		return err
	case <-time.After(waitLong):
		t.Fatalf("the tunnel was not ended within %v", waitLong)
		return nil
	}
}
