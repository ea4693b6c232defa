package e2e

import (
	"fmt"
	"strings"
	"testing"

	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// tunnelsOn is how many tunnels the agent opened on leg, once a scrape
// shows it.
func tunnelsOn(t *testing.T, agent *harness.Process, leg string) float64 {
	t.Helper()
	v, _ := scrape(t, agent, fmt.Sprintf(`kcp_tunnel_agent_tunnels_opened_total{leg=%q}`, leg))
	return v
}

// TestTunnelsRideOnDataConnectionsAndEndCleanly: on the real binaries, with
// the broker's whole chain of credentials, a tunnel takes a data
// connection, carries its bytes and half-closes both ways to an OK end.
func TestTunnelsRideOnDataConnectionsAndEndCleanly(t *testing.T) {
	env := harness.NewEnv(t)
	broker, addr := env.StartBrokerProcess("--log-json")
	agent := env.StartAgentProcess(addr, "/agent/sync-target-1", echoServices(harness.StartEcho(t)))
	// The agent's spares are opened once it is registered.
	testutil.Eventually(t, "the broker to hold the agent's spares", func() bool {
		v, _ := scrape(t, broker, `kcp_tunnel_broker_spare_data_connections`)
		return v == 2
	})
	conn := openEchoTunnel(t, env, addr)
	roundTrip(t, conn, "on a data connection")
	conn.Close()
	lines := broker.WaitLogged(t, 1, `"msg":"tunnel audit"`)
	if got := tunnelsOn(t, agent, "data_connection"); got != 1 {
		t.Errorf("the agent opened %v tunnels on data connections, want 1", got)
	}
	if got := tunnelsOn(t, agent, "stream"); got != 0 {
		t.Errorf("the agent opened %v tunnels on streams, want 0", got)
	}
	if !strings.Contains(lines[0], `"code":"OK"`) {
		t.Errorf("the tunnel did not end OK: %s", lines[0])
	}
}

func TestABrokerWithoutDataConnectionsGetsTunnelStreams(t *testing.T) {
	env := harness.NewEnv(t)
	_, addr := env.StartBrokerProcess("--data-connections=false")
	agent := env.StartAgentProcess(addr, "/agent/sync-target-1", echoServices(harness.StartEcho(t)))
	conn := openEchoTunnel(t, env, addr)
	roundTrip(t, conn, "on a stream")
	if got := tunnelsOn(t, agent, "stream"); got != 1 {
		t.Errorf("the agent opened %v tunnels on streams, want 1", got)
	}
	if got := tunnelsOn(t, agent, "data_connection"); got != 0 {
		t.Errorf("the agent opened %v tunnels on data connections, want 0", got)
	}
}
