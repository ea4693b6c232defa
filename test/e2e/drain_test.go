package e2e

import (
	"context"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

func TestFailoverBrokerDrainsOnSIGTERM(t *testing.T) {
	env := harness.NewEnv(t)
	broker, addr := env.StartBrokerProcess("--grace", "3s")
	echo := harness.StartEcho(t)
	env.StartAgentProcess(addr, "/agent/sync-target-1", lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: "root", Namespace: "default", Name: "echo", Ports: map[string]string{"80": echo}},
	}})
	kcp := brokerDialer(env, addr)
	conn, err := dialEchoConn(kcp)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	roundTrip(t, conn, "before SIGTERM")
	// Ready once its agents have stopped arriving (none for 3s).
	harness.Eventually(t, 20*time.Second, "the broker to be ready", func() bool { return broker.Ready(t) })

	broker.Cmd.Process.Signal(syscall.SIGTERM)
	harness.Eventually(t, 10*time.Second, "readiness to go false", func() bool { return !broker.Ready(t) })
	// Probes and metrics keep answering during the drain: /readyz says 503
	// and why, rather than refusing the connection.
	if code, body := get(t, "http://"+broker.MetricsAddr(t)+"/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "draining") {
		t.Errorf("/readyz while draining: %d %q, want 503 saying draining", code, body)
	}
	// A new dial does not reach the draining replica: once the dials in
	// progress are answered, its GOAWAY and closed listener leave kcp no
	// connection for it, and the only replica is this one.
	impatient := *kcp
	impatient.Timeout = time.Second
	err = dialEcho(&impatient)
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "no tunnel broker reachable") && !strings.Contains(err.Error(), "shutting down") {
		t.Fatalf("dial while draining: %v, want Unavailable: no tunnel broker reachable (or, before the GOAWAY, shutting down)", err)
	}
	// The tunnel in flight goes on during the grace period...
	roundTrip(t, conn, "during the grace period")
	// ...and then ends with a clear status.
	conn.SetReadDeadline(time.Now().Add(20 * time.Second))
	_, err = conn.Read(make([]byte, 1))
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "grace period is over") {
		t.Fatalf("tunnel after the grace period: %v, want Unavailable: grace period is over", err)
	}
}

func TestFailoverAgentDrainsOnSIGTERM(t *testing.T) {
	env := harness.NewEnv(t)
	_, addr := env.StartBrokerProcess()
	echo := harness.StartEcho(t)
	services := lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: "root", Namespace: "default", Name: "echo", Ports: map[string]string{"80": echo}},
	}}
	leaving := env.StartAgentProcess(addr, "/agent/sync-target-1", services, "--grace", "30s")
	kcp := brokerDialer(env, addr)
	// Round-robin: of two tunnels, one goes through each agent.
	first, err := dialEchoConn(kcp)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	env.StartAgentProcess(addr, "/agent/sync-target-2", services)

	leaving.Cmd.Process.Signal(syscall.SIGTERM)
	// The leaving agent's tunnel carries on while it drains.
	harness.Eventually(t, 10*time.Second, "the leaving agent to be unready", func() bool { return !leaving.Ready(t) })
	roundTrip(t, first, "through the draining agent")
	// New dials all go to the staying agent.
	for i := range 20 {
		if err := dialEcho(kcp); err != nil {
			t.Fatalf("dial %d while an agent drains: %v", i, err)
		}
	}
	roundTrip(t, first, "still through the draining agent")
	// Once its last tunnel closes, the draining agent exits by itself.
	first.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	select {
	case <-leaving.Done():
	case <-ctx.Done():
		t.Fatal("the draining agent did not exit after its last tunnel closed")
	}
}
