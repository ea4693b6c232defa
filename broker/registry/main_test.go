package registry

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// This file holds what the registry's tests share: agents, dials run in the
// background, and a stand-in for an agent's Tunnel stream.

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
	tunnel *Tunnel
	err    error
}

// dialing is a Dial running in the background.
type dialing struct {
	t      *testing.T
	cancel context.CancelFunc
	done   chan struct{} // closed when out is set
	out    outcome
}

// startDial runs r.Dial in the background with a context the test cancels
// through the returned dialing, or that ends when the test does.
func startDial(t *testing.T, r *Registry, tgt *tunnelv1.Target) *dialing {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	d := &dialing{t: t, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(d.done)
		d.out.tunnel, d.out.err = r.Dial(ctx, tgt, 1234)
	}()
	// A failed test must not leave the dial running for goleak to find, nor
	// a tunnel open.
	t.Cleanup(func() {
		cancel()
		select {
		case <-d.done:
			if d.out.tunnel != nil {
				d.out.tunnel.Finish(nil)
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

// connected is the tunnel the dial got; a failed dial fails the test.
func (d *dialing) connected() *Tunnel {
	d.t.Helper()
	out := d.wait()
	if out.err != nil {
		d.t.Fatalf("dial: %v", out.err)
	}
	return out.tunnel
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

// orderedTo waits for the next order given to a or b and says which of
// them got it.
func orderedTo(t *testing.T, a, b *Agent) (*Agent, *tunnelv1.DialOrder) {
	t.Helper()
	select {
	case o := <-a.Orders():
		return a, o
	case o := <-b.Orders():
		return b, o
	case <-time.After(waitLong):
		t.Fatalf("neither %s nor %s got an order within %v", a, b, waitLong)
		return nil, nil
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

// claim claims dial dialID for the agent of SPIFFE ID agentID; a refused
// claim fails the test, what naming it.
func claim(t *testing.T, what string, r *Registry, dialID uint64, agentID spiffeid.ID) *Tunnel {
	t.Helper()
	tun, err := r.Claim(dialID, agentID, newFakeTunnelStream())
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	return tun
}

// claimedTunnel is a tunnel through a to cluster, as a dial gets it.
func claimedTunnel(t *testing.T, r *Registry, cluster string, a *Agent) *Tunnel {
	t.Helper()
	d, o := orderedDial(t, r, cluster, a)
	claim(t, "claim", r, o.GetDialId(), a.ID)
	return d.connected()
}

// checkClaimRefused checks that a claim of dial dialID by the agent of SPIFFE
// ID agentID is refused as NotFound.
func checkClaimRefused(t *testing.T, what string, r *Registry, dialID uint64, agentID spiffeid.ID) {
	t.Helper()
	_, err := r.Claim(dialID, agentID, newFakeTunnelStream())
	checkStatus(t, what, err, codes.NotFound,
		fmt.Sprintf("no pending dial %d for %s (it timed out or was cancelled)", dialID, agentID))
}

// inTunnel ends the message of a dial that failed after its order: the
// tunnel id under which the broker logs it.
func inTunnel(dialID uint64) string { return fmt.Sprintf(" (tunnel %016x)", dialID) }

// checkStatus checks err's gRPC code and message.
func checkStatus(t *testing.T, what string, err error, code codes.Code, msg string) {
	t.Helper()
	s, ok := status.FromError(err)
	if !ok {
		t.Errorf("%s: %v is not a gRPC status", what, err)
		return
	}
	if s.Code() != code || s.Message() != msg {
		t.Errorf("%s: got %s %q, want %s %q", what, s.Code(), s.Message(), code, msg)
	}
}

// fakeTunnelStream stands in for an agent's Tunnel stream: the registry only
// hands it from Claim to the dial, so nothing here carries data.
type fakeTunnelStream struct {
	ctx context.Context
}

var _ tunnelv1.AgentService_TunnelServer = (*fakeTunnelStream)(nil)

func newFakeTunnelStream() *fakeTunnelStream {
	return &fakeTunnelStream{ctx: context.Background()}
}

func (*fakeTunnelStream) Recv() (*tunnelv1.TunnelRequest, error) {
	return nil, status.Error(codes.Unimplemented, "fake stream")
}
func (*fakeTunnelStream) Send(*tunnelv1.TunnelResponse) error {
	return status.Error(codes.Unimplemented, "fake stream")
}
func (*fakeTunnelStream) SetHeader(metadata.MD) error  { return nil }
func (*fakeTunnelStream) SendHeader(metadata.MD) error { return nil }
func (*fakeTunnelStream) SetTrailer(metadata.MD)       {}
func (s *fakeTunnelStream) Context() context.Context   { return s.ctx }
func (*fakeTunnelStream) SendMsg(any) error            { return status.Error(codes.Unimplemented, "fake stream") }
func (*fakeTunnelStream) RecvMsg(any) error            { return status.Error(codes.Unimplemented, "fake stream") }

var _ grpc.ServerStream = (*fakeTunnelStream)(nil)
