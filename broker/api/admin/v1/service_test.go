package admin

import (
	"context"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kcp-dev/tunnel-broker/broker/registry"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// ListAgents tells an operator what one replica knows of its agents. Who
// may call it is the broker's authorization interceptor's business, not the
// service's: the tests call it directly, and once over a real gRPC server to
// see it registered.

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// waitLong bounds every wait for something that should happen at once.
const waitLong = 10 * time.Second

func agentID(t *testing.T, path string) spiffeid.ID {
	t.Helper()
	id, err := spiffeid.FromPath(spiffeid.RequireTrustDomainFromString("example.org"), path)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// register registers an agent as the agent service does.
func register(t *testing.T, r *registry.Registry, session, name, path string, clusters ...string) *registry.Agent {
	t.Helper()
	a := registry.NewAgent(session, agentID(t, path), name, clusters)
	r.Register(a)
	return a
}

func list(t *testing.T, s *Service, cluster string) *tunnelv1.ListAgentsResponse {
	t.Helper()
	resp, err := s.ListAgents(t.Context(), &tunnelv1.ListAgentsRequest{Cluster: cluster})
	if err != nil {
		t.Fatalf("ListAgents(%q): %v", cluster, err)
	}
	return resp
}

// sessions are the session ids of the listed agents, in order.
func sessions(resp *tunnelv1.ListAgentsResponse) []string {
	var out []string
	for _, a := range resp.GetAgents() {
		out = append(out, a.GetSessionId())
	}
	return out
}

// noTunnel stands in for the tunnel an agent's Tunnel RPC hands over.
type noTunnel struct{}

func (noTunnel) End(error) {}

// openTunnel opens a tunnel through a for cluster, as a caller's dial and
// the agent's Tunnel RPC do, and returns the dial's claim for the test to
// release.
func openTunnel(t *testing.T, r *registry.Registry, a *registry.Agent, cluster string) *registry.Claim {
	t.Helper()
	type outcome struct {
		claim *registry.Claim
		err   error
	}
	done := make(chan outcome, 1)
	go func() {
		c, err := r.Dial(context.Background(), &tunnelv1.Target{Cluster: cluster, Namespace: "default", Service: "webhook", Port: 443}, nil)
		done <- outcome{c, err}
	}()
	var order *tunnelv1.DialOrder
	select {
	case order = <-a.Orders():
	case <-time.After(waitLong):
		t.Fatalf("agent %s got no order within %v", a, waitLong)
	}
	c, err := r.Claim(order.GetDialId(), a.ID)
	if err != nil {
		t.Fatalf("claim: %v", err)
	}
	c.HandOver(noTunnel{})
	select {
	case o := <-done:
		if o.err != nil {
			t.Fatalf("dial: %v", o.err)
		}
		t.Cleanup(o.claim.Release)
		return o.claim
	case <-time.After(waitLong):
		t.Fatalf("the claimed dial did not end within %v", waitLong)
		return nil
	}
}

func TestListAgentsNamesTheReplica(t *testing.T) {
	s := New(Config{Registry: registry.New(registry.Limits{}), BrokerID: "broker-0"})
	resp := list(t, s, "")
	if resp.GetBrokerId() != "broker-0" {
		t.Errorf("broker_id %q, want broker-0", resp.GetBrokerId())
	}
	if len(resp.GetAgents()) != 0 {
		t.Errorf("an empty registry lists %v", resp.GetAgents())
	}
}

func TestListAgentsDescribesEachRegistration(t *testing.T) {
	r := registry.New(registry.Limits{})
	a := register(t, r, "s1", "sync-target-1", "/agent/a", "zeta", "alpha")
	s := New(Config{Registry: r, BrokerID: "broker-0"})

	resp := list(t, s, "")
	want := &tunnelv1.AgentInfo{
		Name:           "sync-target-1",
		SpiffeId:       "spiffe://example.org/agent/a",
		SessionId:      "s1",
		Clusters:       []string{"alpha", "zeta"},
		ConnectedSince: timestamppb.New(a.Since),
	}
	if len(resp.GetAgents()) != 1 || !proto.Equal(resp.GetAgents()[0], want) {
		t.Errorf("agents %v, want [%v]", resp.GetAgents(), want)
	}
	// Sorting the answer's clusters leaves the registration's alone.
	if got := r.ClustersOf(a); !slices.Equal(got, []string{"zeta", "alpha"}) {
		t.Errorf("the agent's clusters became %v after ListAgents", got)
	}
}

func TestListAgentsReportsTheLastProbeAnswered(t *testing.T) {
	r := registry.New(registry.Limits{})
	a := register(t, r, "s1", "a", "/agent/a", "root")
	at := time.Date(2026, 3, 4, 5, 6, 7, 0, time.UTC)
	a.Probed(at, 1500*time.Microsecond)
	s := New(Config{Registry: r})

	info := list(t, s, "").GetAgents()[0]
	if !proto.Equal(info.GetLastProbe(), timestamppb.New(at)) || !proto.Equal(info.GetLastProbeRtt(), durationpb.New(1500*time.Microsecond)) {
		t.Errorf("last probe %v, rtt %v; want %v, 1.5ms", info.GetLastProbe(), info.GetLastProbeRtt(), at)
	}
}

func TestListAgentsCountsOpenTunnels(t *testing.T) {
	r := registry.New(registry.Limits{})
	a := register(t, r, "s1", "a", "/agent/a", "root")
	s := New(Config{Registry: r})
	first := openTunnel(t, r, a, "root")
	openTunnel(t, r, a, "root")

	if n := list(t, s, "").GetAgents()[0].GetActiveTunnels(); n != 2 {
		t.Errorf("active_tunnels %d, want 2", n)
	}
	first.Release()
	if n := list(t, s, "").GetAgents()[0].GetActiveTunnels(); n != 1 {
		t.Errorf("active_tunnels %d after one tunnel finished, want 1", n)
	}
}

func TestListAgentsShowsWhichAgentsDrain(t *testing.T) {
	r := registry.New(registry.Limits{})
	register(t, r, "s1", "a", "/agent/a", "root")
	draining := register(t, r, "s2", "b", "/agent/b", "root")
	draining.Drain()
	s := New(Config{Registry: r})

	got := map[string]bool{}
	for _, info := range list(t, s, "").GetAgents() {
		got[info.GetSessionId()] = info.GetDraining()
	}
	if got["s1"] || !got["s2"] {
		t.Errorf("draining per session %v, want only s2", got)
	}
}

func TestListAgentsFiltersByCluster(t *testing.T) {
	r := registry.New(registry.Limits{})
	register(t, r, "s1", "a", "/agent/a", "root", "other")
	register(t, r, "s2", "b", "/agent/b", "other")
	register(t, r, "s3", "c", "/agent/c", "root")
	register(t, r, "s4", "d", "/agent/d")
	s := New(Config{Registry: r})

	for cluster, want := range map[string][]string{
		"root":    {"s1", "s3"},
		"other":   {"s1", "s2"},
		"nowhere": nil,
		"":        {"s1", "s2", "s3", "s4"},
	} {
		if got := sessions(list(t, s, cluster)); !slices.Equal(got, want) {
			t.Errorf("ListAgents(%q) lists %v, want %v", cluster, got, want)
		}
	}
}

// A filter that is no logical cluster name is refused, not answered with
// an empty list.
func TestListAgentsRefusesAFilterThatIsNoClusterName(t *testing.T) {
	r := registry.New(registry.Limits{})
	register(t, r, "s1", "a", "/agent/a", "root")
	s := New(Config{Registry: r})
	for _, cluster := range []string{"root:org", "Root", "a/b"} {
		_, err := s.ListAgents(t.Context(), &tunnelv1.ListAgentsRequest{Cluster: cluster})
		testutil.CheckStatus(t, "ListAgents("+cluster+")", err, codes.InvalidArgument, "cluster: ")
	}
}

func TestListAgentsFollowsReRegistrations(t *testing.T) {
	r := registry.New(registry.Limits{})
	a := register(t, r, "s1", "a", "/agent/a", "old")
	s := New(Config{Registry: r})
	r.Update(a, []string{"new"})

	if got := sessions(list(t, s, "old")); len(got) != 0 {
		t.Errorf("ListAgents(old) lists %v after the agent left it", got)
	}
	resp := list(t, s, "new")
	if len(resp.GetAgents()) != 1 || !slices.Equal(resp.GetAgents()[0].GetClusters(), []string{"new"}) {
		t.Errorf("ListAgents(new) = %v, want the agent with clusters [new]", resp.GetAgents())
	}
}

func TestListAgentsListsAgentsServingNoCluster(t *testing.T) {
	r := registry.New(registry.Limits{})
	register(t, r, "s1", "idle", "/agent/idle")
	s := New(Config{Registry: r})

	resp := list(t, s, "")
	if len(resp.GetAgents()) != 1 || resp.GetAgents()[0].GetSessionId() != "s1" || len(resp.GetAgents()[0].GetClusters()) != 0 {
		t.Errorf("agents %v, want the idle agent with no clusters", resp.GetAgents())
	}
}

func TestListAgentsLeavesOutUnregisteredAgents(t *testing.T) {
	r := registry.New(registry.Limits{})
	gone := register(t, r, "s1", "a", "/agent/a", "root")
	register(t, r, "s2", "b", "/agent/b", "root")
	r.Unregister(gone)
	s := New(Config{Registry: r})

	if got := sessions(list(t, s, "")); !slices.Equal(got, []string{"s2"}) {
		t.Errorf("ListAgents lists %v, want [s2]", got)
	}
}

func TestListAgentsOrdersByNameThenSession(t *testing.T) {
	r := registry.New(registry.Limits{})
	// One SPIFFE ID may hold several registrations at once.
	register(t, r, "s-2", "b", "/agent/b", "root")
	register(t, r, "s-1", "b", "/agent/b", "root")
	register(t, r, "s-9", "a-b", "/agent/ab", "root")
	register(t, r, "s-3", "a", "/agent/a", "root")
	s := New(Config{Registry: r})

	want := []string{"s-3", "s-9", "s-1", "s-2"} // a, a-b, b, b
	if got := sessions(list(t, s, "")); !slices.Equal(got, want) {
		t.Errorf("ListAgents lists sessions %v, want %v", got, want)
	}
}

func TestListAgentsIsServedOverGRPC(t *testing.T) {
	r := registry.New(registry.Limits{})
	register(t, r, "s1", "sync-target-1", "/agent/a", "root")
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	RegisterService(srv, New(Config{Registry: r, BrokerID: "broker-0"}))
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	defer func() {
		srv.Stop()
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	}()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()

	ctx, cancel := context.WithTimeout(t.Context(), waitLong)
	defer cancel()
	resp, err := tunnelv1.NewAdminServiceClient(conn).ListAgents(ctx, &tunnelv1.ListAgentsRequest{Cluster: "root"})
	if err != nil {
		t.Fatalf("ListAgents: %v", err)
	}
	if resp.GetBrokerId() != "broker-0" || len(resp.GetAgents()) != 1 ||
		resp.GetAgents()[0].GetName() != "sync-target-1" || resp.GetAgents()[0].GetSpiffeId() != "spiffe://example.org/agent/a" {
		t.Errorf("ListAgents answered %v", resp)
	}
}
