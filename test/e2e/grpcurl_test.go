package e2e

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// TestGrpcurlListsServices uses grpcurl as an operator would, with an SVID
// as its client certificate, against the broker's reflection and health.
func TestGrpcurlListsServices(t *testing.T) {
	env := harness.NewEnv(t)
	b := env.StartBroker(harness.BrokerOptions{})
	grpcurl := harness.Grpcurl(t)
	op := env.SVID("/operator")
	tls := []string{"-cacert", op.Bundle, "-cert", op.Cert, "-key", op.Key}

	out, err := exec.Command(grpcurl, append(tls, b.Addr, "list")...).CombinedOutput()
	if err != nil {
		t.Fatalf("grpcurl list: %v\n%s", err, out)
	}
	for _, svc := range []string{"kcp.tunnel.v1.DialService", "kcp.tunnel.v1.AgentService", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection"} {
		if !strings.Contains(string(out), svc) {
			t.Errorf("grpcurl list does not show %s:\n%s", svc, out)
		}
	}

	out, err = exec.Command(grpcurl, append(tls, b.Addr, "describe", "kcp.tunnel.v1.Target")...).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "uint32 port = 4") {
		t.Errorf("grpcurl describe: %v\n%s", err, out)
	}

	out, err = exec.Command(grpcurl, append(tls, b.Addr, "grpc.health.v1.Health/Check")...).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "SERVING") {
		t.Errorf("grpcurl health check: %v\n%s", err, out)
	}

	// The admin RPC lists the agent, for an operator.
	echo := harness.StartEcho(t)
	env.StartAgent(b.Addr, "/agent/sync-target-1", lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: "root", Namespace: "default", Name: "echo", Ports: map[string]string{"80": echo}},
	}})
	out, err = exec.Command(grpcurl, append(tls, "-d", `{"cluster": "root"}`, b.Addr, "kcp.tunnel.v1.AdminService/ListAgents")...).CombinedOutput()
	if err != nil || !strings.Contains(string(out), `"spiffeId": "spiffe://tunnel.test/agent/sync-target-1"`) || !strings.Contains(string(out), `"root"`) {
		t.Errorf("grpcurl ListAgents: %v\n%s", err, out)
	}
	// A dial by hand: the target first, then bytes; the echo comes back.
	kcp := env.SVID("/kcp")
	dial := `{"target": {"cluster": "root", "namespace": "default", "service": "echo", "port": 80}} {"data": "aGVsbG8K"}`
	out, err = exec.Command(grpcurl, "-cacert", kcp.Bundle, "-cert", kcp.Cert, "-key", kcp.Key,
		"-d", dial, b.Addr, "kcp.tunnel.v1.DialService/Dial").CombinedOutput()
	if err != nil || !strings.Contains(string(out), `"established"`) || !strings.Contains(string(out), `"data": "aGVsbG8K"`) {
		t.Errorf("grpcurl Dial: %v\n%s", err, out)
	}
	// Not for a caller.
	out, err = exec.Command(grpcurl, "-cacert", kcp.Bundle, "-cert", kcp.Cert, "-key", kcp.Key, b.Addr, "kcp.tunnel.v1.AdminService/ListAgents").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "PermissionDenied") {
		t.Errorf("grpcurl ListAgents as a caller: %v\n%s", err, out)
	}

	// Without a client certificate the handshake is refused.
	out, err = exec.Command(grpcurl, "-cacert", op.Bundle, b.Addr, "list").CombinedOutput()
	if err == nil {
		t.Errorf("grpcurl without a client certificate succeeded:\n%s", out)
	}
}
