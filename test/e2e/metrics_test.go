package e2e

import (
	"syscall"
	"testing"
	"time"

	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// scrape reads one sample from a /metrics endpoint; ok is false if absent.
func scrape(t *testing.T, p *harness.Process, series string) (float64, bool) {
	t.Helper()
	return harness.Scrape(t, p, series)
}

func TestMetricsMoveWithTraffic(t *testing.T) {
	env := harness.NewEnv(t)
	broker, addr := env.StartBrokerProcess("--probe-interval", "200ms")
	echo := harness.StartEcho(t)
	agent := env.StartAgentProcess(addr, "/agent/sync-target-1", lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: "root", Namespace: "default", Name: "echo", Ports: map[string]string{"80": echo}},
	}})
	kcp := brokerDialer(env, addr)

	const dials = 5
	for range dials {
		if err := dialEcho(kcp); err != nil {
			t.Fatal(err)
		}
	}
	dialEchoCtxCluster(t.Context(), kcp, "nowhere")

	checkTrafficCounted(t, broker, agent, dials)
	checkProbeSeesHungAgent(t, broker, agent)
}

// checkTrafficCounted checks the broker's and the agent's metrics after
// dials echo round trips of 5 bytes each way and one dial to a cluster no
// agent serves.
func checkTrafficCounted(t *testing.T, broker, agent *harness.Process, dials int) {
	t.Helper()
	want := map[string]float64{
		`kcp_tunnel_broker_dials_total{code="OK"}`: float64(dials),
		// kcpplugin sends a dial no agent of this replica serves to
		// another replica, up to 5 attempts: here, this one each time.
		`kcp_tunnel_broker_dials_total{code="Unavailable"}`:        5,
		`kcp_tunnel_broker_registered_agents`:                      1,
		`kcp_tunnel_broker_clusters_served`:                        1,
		`kcp_tunnel_broker_clusters_single_agent`:                  1,
		`kcp_tunnel_broker_agent_registrations_total`:              1,
		`kcp_tunnel_broker_dial_duration_seconds_count{code="OK"}`: float64(dials),
		`kcp_tunnel_broker_tunnel_bytes_total{direction="up"}`:     float64(dials * 5),
		`kcp_tunnel_broker_tunnel_bytes_total{direction="down"}`:   float64(dials * 5),
		`grpc_server_handled_total{grpc_code="OK",grpc_method="Dial",grpc_service="kcp.tunnel.v1.DialService",grpc_type="bidi_stream"}`: float64(dials),
	}
	harness.Eventually(t, 10*time.Second, "broker metrics to count the traffic", func() bool {
		for series, v := range want {
			if got, _ := scrape(t, broker, series); got != v {
				return false
			}
		}
		return true
	})
	for series, v := range want {
		if got, ok := scrape(t, broker, series); !ok || got != v {
			t.Errorf("%s = %v (present %v), want %v", series, got, ok, v)
		}
	}
	if got, _ := scrape(t, agent, `kcp_tunnel_agent_dials_total{code="OK"}`); got != float64(dials) {
		t.Errorf("agent dials OK = %v, want %d", got, dials)
	}
	if got, _ := scrape(t, agent, `kcp_tunnel_agent_registered_brokers`); got != 1 {
		t.Errorf("agent registered brokers = %v, want 1", got)
	}
}

// checkProbeSeesHungAgent checks that the broker's probe sees the agent,
// and stops seeing it when it hangs (SIGSTOP: no TCP reset, only silence).
func checkProbeSeesHungAgent(t *testing.T, broker, agent *harness.Process) {
	t.Helper()
	reachable := `kcp_tunnel_broker_agent_reachable{agent="sync-target-1",spiffe_id="spiffe://tunnel.test/agent/sync-target-1"}`
	rtt := `kcp_tunnel_broker_agent_probe_rtt_seconds{agent="sync-target-1",spiffe_id="spiffe://tunnel.test/agent/sync-target-1"}`
	harness.Eventually(t, 10*time.Second, "a probe round trip", func() bool {
		v, ok := scrape(t, broker, rtt)
		return ok && v > 0
	})
	if v, _ := scrape(t, broker, reachable); v != 1 {
		t.Fatalf("agent reachable = %v before it hangs", v)
	}
	agent.Cmd.Process.Signal(syscall.SIGSTOP)
	defer agent.Cmd.Process.Signal(syscall.SIGCONT)
	harness.Eventually(t, 10*time.Second, "the probe to report the hung agent unreachable", func() bool {
		v, _ := scrape(t, broker, reachable)
		return v == 0
	})
	agent.Cmd.Process.Signal(syscall.SIGCONT)
	harness.Eventually(t, 10*time.Second, "the probe to see the agent again", func() bool {
		v, _ := scrape(t, broker, reachable)
		return v == 1
	})
}

func TestMetricsReadinessFollowsTheBroker(t *testing.T) {
	env := harness.NewEnv(t)
	broker, addr := env.StartBrokerProcess()
	echo := harness.StartEcho(t)
	agent := env.StartAgentProcess(addr, "/agent/sync-target-1", lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: "root", Namespace: "default", Name: "echo", Ports: map[string]string{"80": echo}},
	}})
	// The broker is ready once its agents have stopped arriving.
	harness.Eventually(t, 20*time.Second, "the broker to be ready", func() bool { return broker.Ready(t) })
	if !agent.Ready(t) {
		t.Fatal("agent not ready at start")
	}
	// Cut the agent off: its only broker dies. It must say it is not ready.
	broker.Kill()
	harness.Eventually(t, 20*time.Second, "the cut-off agent to turn unready", func() bool { return !agent.Ready(t) })
	// And ready again once a broker is back where it was.
	env.StartBrokerProcess("--listen", addr)
	harness.Eventually(t, 20*time.Second, "the agent to be ready again", func() bool { return agent.Ready(t) })
}
