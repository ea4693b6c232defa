package e2e

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/kcp-dev/tunnel-broker/internal/devca"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

func TestAgentMovesToNewConnectionsWhenItsSVIDRotates(t *testing.T) {
	env := harness.NewEnv(t)
	broker, addr := env.StartBrokerProcess()
	// The broker ends a registration once the SVID it was made with has
	// expired: an agent whose SVID rotates must re-register on a new
	// connection before that, and drain the old one.
	f, expires := shortSVID(t, env, "/agent/sync-target-1", 8*time.Second)
	agent := env.RunAgentProcess(addr, "sync-target-1", f, echoServices(harness.StartEcho(t)), "--svid-reload-interval", "50ms")
	kcp := brokerDialer(env, addr)
	harness.Eventually(t, 20*time.Second, "the agent to register", func() bool { return dialEcho(kcp) == nil })

	next, err := env.CA.Issue(devca.Leaf{SPIFFEID: "/agent/sync-target-1"})
	if err != nil {
		t.Fatal(err)
	}
	// The key first: until the certificate follows, the pair does not
	// match and the agent keeps its SVID.
	writeAtomically(t, f.Key, next.KeyPEM)
	writeAtomically(t, f.Cert, next.CertPEM)
	harness.Eventually(t, 20*time.Second, "the agent to register on a new connection", func() bool {
		n, _ := scrape(t, broker, "kcp_tunnel_broker_agent_registrations_total")
		return n == 2
	})
	broker.WaitLogged(t, 1, "agent unregistered")

	time.Sleep(time.Until(expires.Add(time.Second)))
	if err := dialEcho(kcp); err != nil {
		t.Fatalf("after the first SVID expired: %v", err)
	}
	if lines := broker.Logged("agent SVID expired"); len(lines) != 0 {
		t.Errorf("a registration outlived its SVID: %s", lines[0])
	}
	if got, _ := scrape(t, agent, "kcp_tunnel_agent_registered_brokers"); got != 1 {
		t.Errorf("the agent holds %v registrations, want 1", got)
	}
}

// shortSVID writes SVID files for path that expire in a few seconds.
func shortSVID(t *testing.T, env *harness.Env, path string, lifetime time.Duration) (devca.Files, time.Time) {
	t.Helper()
	notAfter := time.Now().Add(lifetime)
	f, err := env.CA.WriteSVID(filepath.Join(env.Dir, "short", filepath.Base(path)), devca.Leaf{SPIFFEID: path, NotAfter: notAfter})
	if err != nil {
		t.Fatal(err)
	}
	// x509 keeps whole seconds.
	return f, notAfter.Truncate(time.Second)
}

func echoServices(echo string) lookup.StaticFile {
	return lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: "root", Namespace: "default", Name: "echo", Ports: map[string]string{"80": echo}},
	}}
}
