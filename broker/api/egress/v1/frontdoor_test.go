package egress

import (
	"log/slog"
	"net/http"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/broker/admission"
	"github.com/kcp-dev/tunnel-broker/broker/internal/brokertest"
	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// A CONNECT tunnel comes in through the broker's one front door, as a
// Dial's does: it is listed while it is open, it leaves an audit line when
// it ends, and it counts in the one quota of its caller, whichever front
// end the caller's other tunnels came through.
func TestAConnectTunnelIsListedAuditedAndCountsInItsCallersOneQuota(t *testing.T) {
	b := startBroker(t)
	var logs testutil.LogBuffer
	table := tunnel.NewTable()
	door := admission.New(admission.Config{
		Registry: b.Registry, Policy: b.Policy, Draining: b.Draining, Timeout: testutil.WaitLong,
		Tunnels:             tunnel.Config{Stopping: b.Stopping, Table: table},
		MaxTunnelsPerCaller: 1,
		BrokerID:            "broker-0",
		Log:                 slog.New(slog.NewJSONHandler(&logs, nil)),
	})
	f := serveTLS(t, b, door)

	agent := f.ConnectAgent(t, agentPath, "agent", "hcp-1")
	conn, r := f.connect(t, apiServerPath, connectTo("10.96.0.10:443"))
	order := agent.Order(t, &tunnelv1.Target{Cluster: "hcp-1", Ip: "10.96.0.10", Port: 443})
	tun, _ := agent.Open(t, order.GetDialId())
	if code, body := answer(t, r); code != http.StatusOK {
		t.Fatalf("answer %d %s, want 200", code, body)
	}

	// The splice lists it as it begins, just after the answer.
	caller := brokertest.ID(apiServerPath)
	testutil.Eventually(t, "the tunnel to be listed", func() bool { l, _ := table.List(tunnel.Filter{Limit: 10}); return len(l) == 1 })
	listed, _ := table.List(tunnel.Filter{Limit: 10})
	if listed[0].CallerID != caller || listed[0].Caller != caller.String() || listed[0].Target.GetIp() != "10.96.0.10" {
		t.Fatalf("the open tunnels list %v, want the CONNECT tunnel of %s", listed, caller)
	}

	// The caller holds its one tunnel: a Dial of the same identity is
	// refused, as is a second CONNECT.
	if _, err := door.Hold(t.Context(), admission.Caller{ID: caller, Frontend: "Dial"}); status.Code(err) != codes.ResourceExhausted {
		t.Errorf("a Dial beside the CONNECT tunnel: %v, want ResourceExhausted", err)
	}
	_, r2 := f.connect(t, apiServerPath, connectTo("10.96.0.10:443"))
	if code, body := answer(t, r2); code != http.StatusTooManyRequests || !strings.Contains(body, "already holds 1 tunnels") {
		t.Errorf("a second CONNECT: %d %q, want 429", code, body)
	}

	roundTrip(t, conn, r, tun)
	testutil.Eventually(t, "the tunnel to leave the listing", func() bool { l, _ := table.List(tunnel.Filter{Limit: 10}); return len(l) == 0 })
	testutil.Eventually(t, "the tunnel's audit line", func() bool {
		return strings.Contains(logs.String(), `"msg":"tunnel audit"`) && strings.Contains(logs.String(), `"frontend":"CONNECT"`)
	})
	if n := door.Held(caller); n != 0 {
		t.Errorf("the caller holds %d tunnels after the end, want 0", n)
	}
}
