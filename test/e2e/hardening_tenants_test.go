package e2e

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// TestHardeningAHangingWebhookDoesNotStarveOtherClusters runs the broker
// and syncer-agent binaries with one agent serving two logical clusters:
// tenant-a's webhook hangs (the agent's connect never completes), tenant-b's
// answers. Twice tenant-a's pending-dial limit of dials wait on tenant-a's
// webhook, so that the broker refuses tenant-a more; tenant-b's dials, through
// the same agent, all succeed meanwhile.
func TestHardeningAHangingWebhookDoesNotStarveOtherClusters(t *testing.T) {
	const limit = 16
	env := harness.NewEnv(t)
	hanging := harness.StartUnanswered(t)
	echo := harness.StartEcho(t)
	// A dial timeout far longer than the test, so that tenant-a's dials
	// are all still pending while tenant-b dials.
	broker, addr := env.StartBrokerProcess("--dial-timeout", "5m", "--max-pending-dials-per-cluster", fmt.Sprint(limit))
	env.StartAgentProcess(addr, "/agent/sync-target-1", lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: "tenant-a", Namespace: "default", Name: "webhook", Ports: map[string]string{"443": hanging}},
		{Cluster: "tenant-b", Namespace: "default", Name: "webhook", Ports: map[string]string{"443": echo}},
	}}, "--grace", "100ms")

	raw := tunnelv1.NewDialServiceClient(env.BrokerConn(addr, "/kcp"))
	ctx, cancel := context.WithCancel(t.Context())
	var hangingDials sync.WaitGroup
	t.Cleanup(func() { cancel(); hangingDials.Wait() })
	refused := make(chan error, 2*limit)
	for range 2 * limit {
		hangingDials.Go(func() {
			err := rawDial(ctx, raw, &tunnelv1.Target{Cluster: "tenant-a", Namespace: "default", Service: "webhook", Port: 443})
			if status.Code(err) == codes.ResourceExhausted {
				refused <- err
			}
		})
	}
	// Tenant-a's queue is full once the broker refuses it: limit dials
	// wait on the agent now, until the test ends.
	select {
	case err := <-refused:
		testutil.CheckStatus(t, "a dial past tenant-a's limit", err, codes.ResourceExhausted, `"tenant-a" has 16 of its dials pending`)
	case <-time.After(30 * time.Second):
		t.Fatal("tenant-a's dials were not refused within 30s: its webhook does not hang?")
	}

	kcp := env.Dialer(addr, "/kcp")
	for i := range 2 * limit {
		conn, err := kcp.DialService(t.Context(), "tenant-b", "default", "webhook", 443)
		if err != nil {
			t.Fatalf("tenant-b's dial %d while tenant-a's webhook hangs: %v", i, err)
		}
		roundTrip(t, conn, fmt.Sprintf("tenant-b %d", i))
		conn.Close()
	}
	if n, _ := scrape(t, broker, `kcp_tunnel_broker_limits_hit_total{limit="pending_dials_per_cluster"}`); n < 1 {
		t.Errorf("the refusals were counted %v times under limit=pending_dials_per_cluster, want at least 1", n)
	}
}
