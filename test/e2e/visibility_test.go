package e2e

import (
	"encoding/json"
	"net"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// Every live tunnel visible (ListTunnels, tunnelctl tunnels, grpcurl) and
// every tunnel audited, on the real broker, agent and tunnelctl binaries.

func openEchoTunnel(t *testing.T, env *harness.Env, addr string) net.Conn {
	t.Helper()
	conn, err := env.Dialer(addr, "/kcp").DialService(t.Context(), "root", "default", "echo", 80)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func TestListTunnelsShowsLiveTunnels(t *testing.T) {
	env := harness.NewEnv(t)
	_, addr := env.StartBrokerProcess("--id", "broker-a")
	env.StartAgentProcess(addr, "/agent/sync-target-1", echoServices(harness.StartEcho(t)))
	first, second := openEchoTunnel(t, env, addr), openEchoTunnel(t, env, addr)
	roundTrip(t, first, "hello") // 6 bytes each way
	roundTrip(t, second, "x")

	out, err := tunnelctl(t, env, addr, "/operator", "tunnels").CombinedOutput()
	if err != nil {
		t.Fatalf("tunnelctl tunnels: %v\n%s", err, out)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if len(lines) != 4 || lines[0] != "broker replica broker-a: 2 tunnels" || !strings.HasPrefix(lines[1], "TUNNEL") {
		t.Fatalf("tunnelctl tunnels printed:\n%s", out)
	}
	// TUNNEL CALLER TARGET AGENT AGE UP DOWN IDLE
	var carried []string
	for _, l := range lines[2:] {
		f := strings.Fields(l)
		if len(f) != 8 || f[1] != "spiffe://tunnel.test/kcp" || f[2] != "root/default/echo:80" || f[3] != "sync-target-1" {
			t.Errorf("tunnel line %q, want kcp's tunnel to root/default/echo:80 through sync-target-1", l)
			continue
		}
		carried = append(carried, f[5]+"/"+f[6])
	}
	slices.Sort(carried)
	if !slices.Equal(carried, []string{"2/2", "6/6"}) {
		t.Errorf("tunnels carried %v bytes up/down, want 2/2 and 6/6", carried)
	}
	out, err = tunnelctl(t, env, addr, "/operator", "tunnels", "--cluster", "elsewhere").CombinedOutput()
	if err != nil || !strings.HasPrefix(string(out), "broker replica broker-a: 0 tunnels") {
		t.Errorf("tunnelctl tunnels --cluster elsewhere: %v\n%s", err, out)
	}

	// grpcurl, with reflection, as an operator; not as a caller.
	grpcurl := harness.Grpcurl(t)
	op, kcp := env.SVID("/operator"), env.SVID("/kcp")
	req := `{"cluster": "root", "caller_spiffe_id": "spiffe://tunnel.test/kcp", "page_size": 1}`
	out, err = exec.Command(grpcurl, "-cacert", op.Bundle, "-cert", op.Cert, "-key", op.Key, "-d", req, addr,
		"kcp.tunnel.v1.AdminService/ListTunnels").CombinedOutput()
	if err != nil || strings.Count(string(out), `"tunnelId"`) != 1 || !strings.Contains(string(out), `"nextPageToken"`) ||
		!strings.Contains(string(out), `"agentName": "sync-target-1"`) {
		t.Errorf("grpcurl ListTunnels, a page of 1: %v\n%s", err, out)
	}
	out, err = exec.Command(grpcurl, "-cacert", kcp.Bundle, "-cert", kcp.Cert, "-key", kcp.Key, addr,
		"kcp.tunnel.v1.AdminService/ListTunnels").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "PermissionDenied") {
		t.Errorf("grpcurl ListTunnels as a caller: %v\n%s", err, out)
	}
}

// auditLine is the README's "Audit log" schema.
type auditLine struct {
	Level, Msg string
	Audit      struct {
		Tunnel, Caller, Cluster, Namespace, Service string
		Port                                        int
		Agent                                       string
		AgentID                                     string `json:"agent_id"`
		Broker                                      string
		Start                                       time.Time
		DurationS                                   float64 `json:"duration_s"`
		BytesUp                                     int64   `json:"bytes_up"`
		BytesDown                                   int64   `json:"bytes_down"`
		Code                                        string
	}
}

func TestAuditLogLinePerTunnel(t *testing.T) {
	env := harness.NewEnv(t)
	broker, addr := env.StartBrokerProcess("--id", "broker-a", "--log-json")
	env.StartAgentProcess(addr, "/agent/sync-target-1", echoServices(harness.StartEcho(t)))
	before := time.Now()
	conn := openEchoTunnel(t, env, addr)
	roundTrip(t, conn, "audited") // 8 bytes each way
	conn.Close()

	lines := broker.WaitLogged(t, 1, `"msg":"tunnel audit"`)
	var got auditLine
	if err := json.Unmarshal([]byte(lines[0]), &got); err != nil {
		t.Fatalf("audit line %s: %v", lines[0], err)
	}
	a := got.Audit
	if got.Level != "INFO" || a.Caller != "spiffe://tunnel.test/kcp" || a.Cluster != "root" || a.Namespace != "default" ||
		a.Service != "echo" || a.Port != 80 || a.Agent != "sync-target-1" || a.AgentID != "spiffe://tunnel.test/agent/sync-target-1" ||
		a.Broker != "broker-a" || a.BytesUp != 8 || a.BytesDown != 8 || a.Code != "OK" || len(a.Tunnel) != 16 {
		t.Errorf("audit line %s", lines[0])
	}
	if a.Start.Before(before.Add(-time.Second)) || a.Start.After(time.Now()) || a.DurationS < 0 {
		t.Errorf("audit start %v, duration %vs: not this tunnel's", a.Start, a.DurationS)
	}
}

func TestAgentRetryOnAnotherAgent(t *testing.T) {
	env := harness.NewEnv(t)
	_, addr := env.StartBrokerProcess()
	echo, refused := harness.StartEcho(t), freeAddr(t, "127.0.0.1")
	env.StartAgentProcess(addr, "/agent/sync-target-1", echoServices(refused))
	second := env.StartAgentProcess(addr, "/agent/sync-target-2", echoServices(echo))
	kcp := env.Dialer(addr, "/kcp")

	// Round-robin sends every other dial to the agent whose target
	// refuses; each is retried on the other.
	for i := range 6 {
		conn, err := kcp.DialService(t.Context(), "root", "default", "echo", 80)
		if err != nil {
			t.Fatalf("dial %d, one agent's target refusing: %v", i, err)
		}
		roundTrip(t, conn, "through the other agent")
		conn.Close()
	}

	// The other agent drains and goes: both now fail, and the caller
	// sees one error.
	if err := second.Stop(); err != nil {
		t.Logf("the second agent stopped with %v", err)
	}
	_, err := kcp.DialService(t.Context(), "root", "default", "echo", 80)
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "agent sync-target-1") {
		t.Errorf("dial with every agent failing: %v, want Unavailable from sync-target-1", err)
	}
}

func TestAgentRetryAllFailWithOneError(t *testing.T) {
	env := harness.NewEnv(t)
	_, addr := env.StartBrokerProcess()
	env.StartAgentProcess(addr, "/agent/sync-target-1", echoServices(freeAddr(t, "127.0.0.1")))
	env.StartAgentProcess(addr, "/agent/sync-target-2", echoServices(freeAddr(t, "127.0.0.1")))
	_, err := env.Dialer(addr, "/kcp").DialService(t.Context(), "root", "default", "echo", 80)
	msg := status.Convert(err).Message()
	if status.Code(err) != codes.Unavailable || strings.Count(msg, "(tunnel ") != 2 || !strings.Contains(msg, "; before it, agent sync-target-") ||
		!strings.Contains(msg, "sync-target-1") || !strings.Contains(msg, "sync-target-2") {
		t.Errorf("dial with both agents' targets refusing: %v, want one Unavailable naming both", err)
	}
}
