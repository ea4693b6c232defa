package e2e

import (
	"context"
	"io"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/internal/devca"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	"github.com/kcp-dev/tunnel-broker/kcpplugin"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// authzPolicy binds syncer-{syncTarget} agents to their sync targets'
// clusters, lets /kcp dial anything and /team-a dial only team-a.
func authzPolicy() *policy.File {
	td := "spiffe://" + harness.TrustDomain
	return &policy.File{
		Agents:      []policy.AgentRule{{ID: td + "/syncer-{syncTarget}"}},
		SyncTargets: map[string][]string{"east": {"root", "team-a"}, "west": {"team-b"}},
		Callers:     []policy.CallerRule{{ID: td + "/kcp"}, {ID: td + "/team-a", Clusters: []string{"team-a"}}},
		Operators:   []policy.OperatorRule{{ID: td + "/operator"}},
	}
}

// startAuthzWorld runs a broker with authzPolicy and the east agent serving
// an echo Service in root and team-a.
func startAuthzWorld(t *testing.T) (*harness.Env, *harness.Broker) {
	env := harness.NewEnv(t)
	b := env.StartBroker(harness.BrokerOptions{Policy: authzPolicy()})
	echo := harness.StartEcho(t)
	env.StartAgent(b.Addr, "/syncer-east", lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: "root", Namespace: "default", Name: "echo", Ports: map[string]string{"80": echo}},
		{Cluster: "team-a", Namespace: "default", Name: "echo", Ports: map[string]string{"80": echo}},
	}})
	return env, b
}

func dialAs(t *testing.T, d *kcpplugin.Dialer, cluster string) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := d.DialService(ctx, cluster, "default", "echo", 80)
	if conn != nil {
		conn.Close()
	}
	return err
}

func TestAuthzCallers(t *testing.T) {
	env, b := startAuthzWorld(t)
	kcp := waitingDialer(env.ConnWith(b.Addr, env.Identity("/kcp")))
	teamA := waitingDialer(env.ConnWith(b.Addr, env.Identity("/team-a")))
	stranger := waitingDialer(env.ConnWith(b.Addr, env.Identity("/stranger")))
	agentAsCaller := waitingDialer(env.ConnWith(b.Addr, env.Identity("/syncer-east")))

	for _, tc := range []struct {
		name    string
		dialer  *kcpplugin.Dialer
		cluster string
		code    codes.Code
		message string
	}{
		{"kcp dials root", kcp, "root", codes.OK, ""},
		{"kcp dials team-a", kcp, "team-a", codes.OK, ""},
		{"team-a dials its cluster", teamA, "team-a", codes.OK, ""},
		{"team-a dials root", teamA, "root", codes.PermissionDenied, `may not dial logical cluster "root"`},
		{"team-a dials a cluster nobody serves", teamA, "nowhere", codes.PermissionDenied, `may not dial logical cluster "nowhere"`},
		{"stranger dials a served cluster", stranger, "root", codes.PermissionDenied, "may not call /kcp.tunnel.v1.DialService/Dial"},
		{"stranger dials an unserved cluster", stranger, "nowhere", codes.PermissionDenied, "may not call /kcp.tunnel.v1.DialService/Dial"},
		{"an agent dials", agentAsCaller, "root", codes.PermissionDenied, "may not call /kcp.tunnel.v1.DialService/Dial"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := dialAs(t, tc.dialer, tc.cluster)
			if tc.code == codes.OK {
				if err != nil {
					t.Fatalf("dial: %v", err)
				}
				return
			}
			testutil.CheckStatus(t, "kcpplugin", err, tc.code, tc.message)
		})
	}
}

func TestAuthzAgentClaimingAnotherSyncTargetIsRefused(t *testing.T) {
	env, b := startAuthzWorld(t)
	for _, tc := range []struct {
		name     string
		agent    string
		clusters []string
		message  string
	}{
		{"west claims east's cluster", "/syncer-west", []string{"team-b", "root"}, `may not serve logical cluster "root"`},
		{"unknown sync target", "/syncer-north", []string{"team-b"}, `may not serve logical cluster "team-b"`},
		{"caller registers as agent", "/kcp", []string{"root"}, "may not call /kcp.tunnel.v1.AgentService/Connect"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client := tunnelv1.NewAgentServiceClient(env.ConnWith(b.Addr, env.Identity(tc.agent)))
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			stream, err := client.Connect(ctx)
			if err != nil {
				t.Fatal(err)
			}
			stream.Send(&tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Register{Register: &tunnelv1.Register{Clusters: tc.clusters}}})
			_, err = stream.Recv()
			testutil.CheckStatus(t, "Connect", err, codes.PermissionDenied, tc.message)
		})
	}
	// Nothing the refused agents claimed is routed: team-b has no agent.
	kcp := waitingDialer(env.ConnWith(b.Addr, env.Identity("/kcp")))
	testutil.CheckStatus(t, "dial", dialAs(t, kcp, "team-b"), codes.Unavailable, `no agent serves logical cluster "team-b"`)

	// An agent that re-registers with a cluster it is not bound to loses its
	// control stream, and its earlier registration with it.
	client := tunnelv1.NewAgentServiceClient(env.ConnWith(b.Addr, env.Identity("/syncer-west")))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	stream, err := client.Connect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	stream.Send(&tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Register{Register: &tunnelv1.Register{Clusters: []string{"team-b"}}}})
	if _, err := stream.Recv(); err != nil {
		t.Fatalf("west registering team-b: %v", err)
	}
	stream.Send(&tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Register{Register: &tunnelv1.Register{Clusters: []string{"team-b", "team-a"}}}})
	for err == nil {
		_, err = stream.Recv()
	}
	testutil.CheckStatus(t, "re-register", err, codes.PermissionDenied, `may not serve logical cluster "team-a"`)
	harness.Eventually(t, 10*time.Second, "west's registration to go", func() bool {
		return dialAs(t, kcp, "team-b") != nil
	})
}

func TestAuthzHandshakeRefusesForeignAndExpiredSVIDs(t *testing.T) {
	env, b := startAuthzWorld(t)
	other, err := devca.New("other CA", "other.test")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		src  func() *kcpplugin.Dialer
	}{
		{"trust domain the broker does not trust", func() *kcpplugin.Dialer {
			// It trusts the broker (federated bundle), not the other way round.
			return waitingDialer(env.ConnWith(b.Addr, env.Source(other, devca.Leaf{SPIFFEID: "/kcp"}, env.CA)))
		}},
		{"same path, impostor CA in our trust domain", func() *kcpplugin.Dialer {
			impostor, err := devca.New("impostor", harness.TrustDomain)
			if err != nil {
				t.Fatal(err)
			}
			src := env.Source(impostor, devca.Leaf{SPIFFEID: "/kcp"})
			return waitingDialer(env.ConnWith(b.Addr, src))
		}},
		{"expired SVID", func() *kcpplugin.Dialer {
			src := env.Source(env.CA, devca.Leaf{SPIFFEID: "/kcp", NotBefore: time.Now().Add(-2 * time.Hour), NotAfter: time.Now().Add(-time.Hour)})
			return waitingDialer(env.ConnWith(b.Addr, src))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := dialAs(t, tc.src(), "root")
			if err == nil {
				t.Fatal("the broker accepted the handshake")
			}
			testutil.CheckStatus(t, "kcpplugin", err, codes.Unavailable, "")
		})
	}
}

func TestAuthzHealthOnlyForKnownPeers(t *testing.T) {
	env, b := startAuthzWorld(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, tc := range []struct {
		path string
		code codes.Code
	}{
		{"/operator", codes.OK},
		{"/kcp", codes.OK},
		{"/syncer-east", codes.OK},
		{"/stranger", codes.PermissionDenied},
	} {
		_, err := healthpb.NewHealthClient(env.ConnWith(b.Addr, env.Identity(tc.path))).Check(ctx, &healthpb.HealthCheckRequest{})
		switch {
		case tc.code == codes.OK && err != nil:
			t.Errorf("%s: health check: %v", tc.path, err)
		case tc.code != codes.OK:
			testutil.CheckStatus(t, tc.path, err, tc.code, "may not call /grpc.health.v1.Health/Check")
		}
	}
}

// TestAuthzRotationKeepsOpenTunnels rotates the broker's SVID files while a
// tunnel carries traffic: the tunnel goes on, and new handshakes get the new
// SVID.
func TestAuthzRotationKeepsOpenTunnels(t *testing.T) {
	env := harness.NewEnv(t)
	files := env.SVID("/broker")
	brokerSrc := loadWatched(t, files)
	b := env.StartBroker(harness.BrokerOptions{Identity: brokerSrc})
	echo := harness.StartEcho(t)
	env.StartAgent(b.Addr, "/agent/sync-target-1", lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: "root", Namespace: "default", Name: "echo", Ports: map[string]string{"80": echo}},
	}})
	kcp := env.Dialer(b.Addr, "/kcp")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := kcp.DialService(ctx, "root", "default", "echo", 80)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	roundTrip(t, conn, "before rotation")
	before := brokerSerial(t, env, b.Addr)

	// Rotate: new SVID for the same ID, written over the same files.
	rotated, err := env.CA.Issue(devca.Leaf{SPIFFEID: "/broker"})
	if err != nil {
		t.Fatal(err)
	}
	writeAtomically(t, files.Key, rotated.KeyPEM)
	writeAtomically(t, files.Cert, rotated.CertPEM)
	harness.Eventually(t, 10*time.Second, "new handshakes to use the rotated SVID", func() bool {
		return brokerSerial(t, env, b.Addr) != before
	})
	roundTrip(t, conn, "after rotation")
	if err := conn.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if rest, err := io.ReadAll(conn); err != nil || len(rest) != 0 {
		t.Fatalf("after half-close: %q, %v", rest, err)
	}
}

// TestAuthzFederatedAgent: an agent of another trust domain registers and
// serves dials when the broker trusts that domain's bundle and its policy
// names the agent; the agent trusts the broker's domain in turn.
func TestAuthzFederatedAgent(t *testing.T) {
	env := harness.NewEnv(t)
	partner, err := devca.New("partner CA", "partner.test")
	if err != nil {
		t.Fatal(err)
	}
	pol := harness.DefaultPolicy()
	pol.Agents = append(pol.Agents, policy.AgentRule{ID: "spiffe://partner.test/syncer-east", Clusters: []string{"root"}})
	brokerID := env.Source(env.CA, devca.Leaf{SPIFFEID: "/broker"}, partner)
	b := env.StartBroker(harness.BrokerOptions{Policy: &pol, Identity: brokerID})
	resolver, err := lookup.NewStatic(lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: "root", Namespace: "default", Name: "echo", Ports: map[string]string{"80": harness.StartEcho(t)}},
	}})
	if err != nil {
		t.Fatal(err)
	}
	env.StartAgentAs(b.Addr, "syncer-east", env.Source(partner, devca.Leaf{SPIFFEID: "/syncer-east"}, env.CA), resolver)

	conn, err := dialEchoConn(env.Dialer(b.Addr, "/kcp"))
	if err != nil {
		t.Fatalf("dial through the federated agent: %v", err)
	}
	defer conn.Close()
	roundTrip(t, conn, "through a partner.test agent")

	// The same agent without a policy entry is refused, though trusted.
	other := tunnelv1.NewAgentServiceClient(env.ConnWith(b.Addr, env.Source(partner, devca.Leaf{SPIFFEID: "/syncer-west"}, env.CA)))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	stream, err := other.Connect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	stream.Send(&tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Register{Register: &tunnelv1.Register{Clusters: []string{"root"}}}})
	_, err = stream.Recv()
	testutil.CheckStatus(t, "unlisted partner agent", err, codes.PermissionDenied, "spiffe://partner.test/syncer-west may not call")
}
