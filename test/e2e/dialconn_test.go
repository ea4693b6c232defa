package e2e

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	"github.com/kcp-dev/tunnel-broker/kcpplugin"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// callerLegs is how many tunnels the broker spliced with a caller's leg of
// kind leg, once a scrape shows it.
func callerLegs(t *testing.T, broker *harness.Process, leg string) float64 {
	t.Helper()
	v, _ := scrape(t, broker, fmt.Sprintf(`kcp_tunnel_broker_tunnels_opened_total{caller_leg=%q}`, leg))
	return v
}

// TestAWebhookCallRidesOnDialAndDataConnections: on the real binaries, the
// real webhook client's call goes through kcpplugin's dial connection and
// the agent's data connection, with TLS end to end to the webhook (its
// caBundle and ServerName checked by the client), and no gRPC stream on
// either leg.
func TestAWebhookCallRidesOnDialAndDataConnections(t *testing.T) {
	env := harness.NewEnv(t)
	wh := harness.StartWebhook(t, harness.WebhookOptions{Namespace: "default", Name: "webhook"}, review)
	// The webhook client keeps its connection for the next call: closing
	// the dialer (at the test's end) ends its tunnel, so the processes
	// need not wait for it as they stop.
	broker, addr := env.StartBrokerProcess()
	agent := env.StartAgentProcess(addr, "/agent/sync-target-1", lookup.StaticFile{Services: []lookup.StaticService{{
		Cluster: cluster, Namespace: "default", Name: "webhook", Ports: map[string]string{"443": wh.Addr},
	}}})
	dialer := env.DirectDialer(addr, "/kcp")
	dialer.EarlyData = true
	testutil.Eventually(t, "the broker to hold kcp's and the agent's spares", func() bool {
		dials, _ := scrape(t, broker, `kcp_tunnel_broker_spare_dial_connections`)
		data, _ := scrape(t, broker, `kcp_tunnel_broker_spare_data_connections`)
		return dials == kcpplugin.DefaultSpares && data == 2
	})
	svc := harness.WebhookService{Namespace: "default", Name: "webhook", Path: "/admit", Port: 443, CABundle: wh.CABundle}
	adm := harness.NewAdmission(t, harness.AdmissionOptions{Service: svc, Wrapper: kcpplugin.AuthInfoResolverWrapper(cluster, dialer)})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := adm.Admit(ctx, configMap(nil)); err != nil {
		t.Fatalf("allowed request: %v", err)
	}
	if got := callerLegs(t, broker, "dial_connection"); got < 1 {
		t.Errorf("the broker spliced %v tunnels on dial connections, want the webhook's", got)
	}
	if got := callerLegs(t, broker, "stream"); got != 0 {
		t.Errorf("the broker spliced %v tunnels on Dial streams, want 0", got)
	}
	if got := tunnelsOn(t, agent, "stream"); got != 0 {
		t.Errorf("the agent opened %v tunnels on streams, want 0", got)
	}
}

// TestDialConnectionsEndCleanlyAndRefillTheirSpares: a tunnel on a dial
// connection half-closes both ways to an OK audit line, and kcpplugin
// opens a spare in place of the one it used.
func TestDialConnectionsEndCleanlyAndRefillTheirSpares(t *testing.T) {
	env := harness.NewEnv(t)
	broker, addr := env.StartBrokerProcess("--log-json")
	env.StartAgentProcess(addr, "/agent/sync-target-1", echoServices(harness.StartEcho(t)))
	dialer := env.DirectDialer(addr, "/kcp")
	spares := func() bool {
		v, _ := scrape(t, broker, `kcp_tunnel_broker_spare_dial_connections`)
		return v == kcpplugin.DefaultSpares
	}
	testutil.Eventually(t, "the broker to hold kcp's spares", spares)
	conn, err := dialer.DialService(t.Context(), "root", "default", "echo", 80)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	roundTrip(t, conn, "on a dial connection")
	testutil.Eventually(t, "kcpplugin to replace the spare it used", spares)
	if err := conn.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	lines := broker.WaitLogged(t, 1, `"msg":"tunnel audit"`, `"code":"OK"`)
	if len(lines) != 1 {
		t.Fatalf("audit lines %q", lines)
	}
	if got := callerLegs(t, broker, "dial_connection"); got != 1 {
		t.Errorf("the broker spliced %v tunnels on dial connections, want 1", got)
	}
}

func TestABrokerWithoutDialConnectionsGetsDialStreams(t *testing.T) {
	env := harness.NewEnv(t)
	broker, addr := env.StartBrokerProcess("--data-connections=false")
	env.StartAgentProcess(addr, "/agent/sync-target-1", echoServices(harness.StartEcho(t)))
	conn, err := env.DirectDialer(addr, "/kcp").DialService(t.Context(), "root", "default", "echo", 80)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	roundTrip(t, conn, "on a stream")
	if got := callerLegs(t, broker, "stream"); got != 1 {
		t.Errorf("the broker spliced %v tunnels on Dial streams, want 1", got)
	}
	if got := callerLegs(t, broker, "dial_connection"); got != 0 {
		t.Errorf("the broker spliced %v tunnels on dial connections, want 0", got)
	}
}

// TestDialAndDataConnectionsCarryOneTunnelAfterAnother: on the real
// binaries, dials one after another, each closed by kcp after a round trip,
// ride the connections their spares left idle (docs/protocol.md §3.7):
// every tunnel's end exchange leaves its dial connection idle for the
// next, and its data connection too, none is reset, and no dial falls back
// to a Dial stream. The agent's leg may: its 2 spares can both still be
// ending their tunnels when the next dial comes; without reuse, a dozen
// connections would have carried the 40.
func TestDialAndDataConnectionsCarryOneTunnelAfterAnother(t *testing.T) {
	env := harness.NewEnv(t)
	broker, addr := env.StartBrokerProcess()
	agent := env.StartAgentProcess(addr, "/agent/sync-target-1", echoServices(harness.StartEcho(t)))
	dialer := env.DirectDialer(addr, "/kcp")
	dialer.EarlyData = true
	testutil.Eventually(t, "the broker to hold kcp's and the agent's spares", func() bool {
		dials, _ := scrape(t, broker, `kcp_tunnel_broker_spare_dial_connections`)
		data, _ := scrape(t, broker, `kcp_tunnel_broker_spare_data_connections`)
		return dials == kcpplugin.DefaultSpares && data == 2
	})
	const tunnels = 40
	for i := range tunnels {
		conn, err := dialer.DialService(t.Context(), "root", "default", "echo", 80)
		if err != nil {
			t.Fatal(err)
		}
		roundTrip(t, conn, fmt.Sprintf("tunnel %d", i))
		conn.Close()
	}
	ended := func(leg, connection string) float64 {
		v, _ := scrape(t, broker, fmt.Sprintf(`kcp_tunnel_broker_connection_tunnels_ended_total{connection=%q,leg=%q}`, connection, leg))
		return v
	}
	testutil.Eventually(t, "every tunnel to end", func() bool {
		return ended("dial_connection", "idle") == tunnels &&
			ended("data_connection", "idle")+tunnelsOn(t, agent, "stream") == tunnels
	})
	for _, leg := range []string{"dial_connection", "data_connection"} {
		if n := ended(leg, "reset"); n != 0 {
			t.Errorf("%v tunnels reset their %s", n, leg)
		}
	}
	if n := ended("data_connection", "idle"); n < tunnels/2 {
		t.Errorf("%v of %d tunnels rode a data connection and left it idle, want most", n, tunnels)
	}
	if got := callerLegs(t, broker, "stream"); got != 0 {
		t.Errorf("the broker spliced %v tunnels on Dial streams, want 0", got)
	}
}
