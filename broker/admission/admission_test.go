package admission_test

import (
	"context"
	"testing"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"

	"github.com/kcp-dev/tunnel-broker/broker/admission"
	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/broker/registry"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// The front door's own decisions, without a front end: the tests of the
// Dial RPC (broker/api/dial/v1) and of the CONNECT front end
// (broker/api/egress/v1) drive it through real streams and connections.

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var kcp = spiffeid.RequireFromString("spiffe://example.org/kcp")

func newDoor(t *testing.T, cfg admission.Config) *admission.Admission {
	t.Helper()
	p, err := policy.New(policy.File{
		Agents:  []policy.AgentRule{{ID: "spiffe://example.org/agent", Clusters: []string{"*"}}},
		Callers: []policy.CallerRule{{ID: kcp.String(), Clusters: []string{"root"}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	cfg.Registry, cfg.Policy = registry.New(registry.Limits{}), p
	return admission.New(cfg)
}

func TestOneQuotaCountsACallersTunnelsWhicheverFrontEndTheyComeThrough(t *testing.T) {
	door := newDoor(t, admission.Config{MaxTunnelsPerCaller: 2})
	dial, err := door.Hold(t.Context(), admission.Caller{ID: kcp, Frontend: "Dial"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := door.Hold(t.Context(), admission.Caller{ID: kcp, Frontend: "CONNECT", Authorized: true}); err != nil {
		t.Fatal(err)
	}
	_, err = door.Hold(t.Context(), admission.Caller{ID: kcp, Frontend: "Dial"})
	testutil.CheckStatus(t, "a third tunnel", err, codes.ResourceExhausted, "already holds 2 tunnels")
	// A ticket given back, twice even, counts once.
	dial.Release()
	dial.Release()
	if n := door.Held(kcp); n != 1 {
		t.Errorf("the caller holds %d, want 1", n)
	}
}

func TestADialIsCheckedBeforeItIsOrdered(t *testing.T) {
	draining, drain := context.WithCancel(context.Background())
	door := newDoor(t, admission.Config{Draining: draining})
	ticket, err := door.Hold(t.Context(), admission.Caller{ID: kcp, Frontend: "Dial"})
	if err != nil {
		t.Fatal(err)
	}
	defer ticket.Release()
	root := &tunnelv1.Target{Cluster: "root", Namespace: "default", Service: "webhook", Port: 443}
	for _, c := range []struct {
		name   string
		target *tunnelv1.Target
		early  int
		code   codes.Code
		msg    string
	}{
		{"no target", nil, 0, codes.InvalidArgument, "must name a target"},
		{"a path, not a cluster", &tunnelv1.Target{Cluster: "root:org", Namespace: "default", Service: "webhook", Port: 443}, 0, codes.InvalidArgument, ""},
		{"too much early data", root, wire.MaxEarlyData + 1, codes.InvalidArgument, "early data may be at most"},
		{"a cluster the policy does not give", &tunnelv1.Target{Cluster: "team-a", Namespace: "default", Service: "webhook", Port: 443}, 0, codes.PermissionDenied, ""},
		{"no agent", root, 0, codes.Unavailable, "no agent serves"},
	} {
		_, err := ticket.Dial(t.Context(), c.target, make([]byte, c.early))
		testutil.CheckStatus(t, c.name, err, c.code, c.msg)
	}
	drain()
	_, err = ticket.Dial(t.Context(), root, nil)
	testutil.CheckStatus(t, "while draining", err, codes.Unavailable, "shutting down")
}
