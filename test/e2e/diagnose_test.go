package e2e

import (
	"context"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/internal/devca"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// These tests get each side's own identity wrong, and check that the side
// that holds the wrong identity says so itself, in its log and its /readyz,
// rather than leave it to the other side's log.

// svidFrom writes an SVID for path signed by ca, with a trust bundle that
// also holds the test CA, so that the holder trusts the broker.
func svidFrom(t *testing.T, env *harness.Env, ca *devca.CA, path string, leaf devca.Leaf) devca.Files {
	t.Helper()
	leaf.SPIFFEID = path
	dir, err := os.MkdirTemp(env.Dir, "svid")
	if err != nil {
		t.Fatal(err)
	}
	f, err := ca.WriteSVID(dir, leaf)
	if err != nil {
		t.Fatal(err)
	}
	if ca != env.CA {
		if err := os.WriteFile(f.Bundle, append(ca.BundlePEM(), env.CA.BundlePEM()...), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return f
}

// notReadyBecause checks that an agent's /readyz is 503 and says why, in
// the words of its log.
func notReadyBecause(t *testing.T, agent *harness.Process, words string) {
	t.Helper()
	code, body := get(t, "http://"+agent.MetricsAddr(t)+"/readyz")
	if code != http.StatusServiceUnavailable || !strings.Contains(body, words) {
		t.Errorf("/readyz: %d %q, want 503 saying %q", code, body, words)
	}
}

func TestAgentWithAnExpiredSVIDSaysItExpired(t *testing.T) {
	env := harness.NewEnv(t)
	_, addr := env.StartBrokerProcess()
	expiry := time.Now().Add(-time.Minute).Truncate(time.Second)
	f := svidFrom(t, env, env.CA, "/agent/sync-target-1", devca.Leaf{NotBefore: expiry.Add(-time.Hour), NotAfter: expiry})
	agent := env.RunAgentProcess(addr, "sync-target-1", f, echoServices("127.0.0.1:1"))
	said := "my SVID expired at " + expiry.UTC().Format(time.RFC3339) + " and no new one has come"
	agent.WaitLogged(t, 1, "ERROR", said, "--spiffe-socket", "--svid-cert", "broker="+addr)
	notReadyBecause(t, agent, said)
}

func TestAgentWhoseCATheBrokerDoesNotTrustSaysItsCertificateWasRefused(t *testing.T) {
	env := harness.NewEnv(t)
	_, addr := env.StartBrokerProcess()
	stranger, err := devca.New("stranger", harness.TrustDomain)
	if err != nil {
		t.Fatal(err)
	}
	f := svidFrom(t, env, stranger, "/agent/sync-target-1", devca.Leaf{})
	agent := env.RunAgentProcess(addr, "sync-target-1", f, echoServices("127.0.0.1:1"))
	said := "the broker refused my certificate (spiffe://" + harness.TrustDomain + "/agent/sync-target-1, TLS alert: bad certificate): " +
		"is my trust domain's CA in the broker's bundle (or --federated-bundle)?"
	line := agent.WaitLogged(t, 1, "ERROR", said, "broker="+addr)[0]
	if strings.Contains(line, "expired") {
		t.Errorf("a valid SVID is said to have expired: %s", line)
	}
	notReadyBecause(t, agent, said)
}

// An SVID that nothing renews: the agent warns in the last quarter of its
// lifetime, the broker ends the registration at its expiry, and the agent
// then says that it expired.
func TestAgentWhoseSVIDRunsOutWarnsThenSaysItExpired(t *testing.T) {
	env := harness.NewEnv(t)
	_, addr := env.StartBrokerProcess()
	now := time.Now().Truncate(time.Second)
	expiry := now.Add(18 * time.Second)
	f := svidFrom(t, env, env.CA, "/agent/sync-target-1", devca.Leaf{NotBefore: now.Add(-2 * time.Second), NotAfter: expiry})
	agent := env.RunAgentProcess(addr, "sync-target-1", f, echoServices("127.0.0.1:1"), "--svid-reload-interval", "1s")
	harness.Eventually(t, 10*time.Second, "the agent to register", func() bool { return agent.Ready(t) })
	line := agent.WaitLogged(t, 1, "WARN", "my SVID expires in", "and no new one has come", "expires_at="+expiry.UTC().Format(time.RFC3339))[0]
	if strings.Contains(line, "my SVID expires in 0s") {
		t.Errorf("warned only at the expiry: %s", line)
	}
	said := "my SVID expired at " + expiry.UTC().Format(time.RFC3339)
	agent.WaitLogged(t, 1, "ERROR", said)
	notReadyBecause(t, agent, said)
}

// tunnelctl, whose certificate the broker refuses, says so, instead of
// blaming the broker's reachability.
func TestTunnelctlExplainsItsOwnCertificate(t *testing.T) {
	env := harness.NewEnv(t)
	_, addr := env.StartBrokerProcess()
	expiry := time.Now().Add(-time.Minute).Truncate(time.Second)
	expired := svidFrom(t, env, env.CA, "/operator", devca.Leaf{NotBefore: expiry.Add(-time.Hour), NotAfter: expiry})
	stranger, err := devca.New("stranger", harness.TrustDomain)
	if err != nil {
		t.Fatal(err)
	}
	untrusted := svidFrom(t, env, stranger, "/operator", devca.Leaf{})
	for _, tc := range []struct {
		f    devca.Files
		want string
	}{
		{expired, "your SVID (--svid-cert) expired at " + expiry.UTC().Format(time.RFC3339)},
		{untrusted, "the broker refused your certificate (spiffe://" + harness.TrustDomain + "/operator, TLS alert: bad certificate): is your trust domain's CA in the broker's bundle"},
	} {
		out := refusedAtStart(t, "tunnelctl", "--svid-cert", tc.f.Cert, "--svid-key", tc.f.Key, "--trust-bundle", tc.f.Bundle, "--broker", addr, "agents")
		wantIn(t, out, tc.want)
		if strings.Contains(out, "not reachable") {
			t.Errorf("tunnelctl blames the broker's reachability for its own certificate:\n%s", out)
		}
	}
}

// What kcp shows its end users, when the broker is down and when an agent
// stops in the middle of a tunnel, says why in words, without an address.
func TestKCPSeesWordsNotAddresses(t *testing.T) {
	env := harness.NewEnv(t)
	gone := closedPort(t)
	d := env.Dialer(gone, "/kcp")
	d.Timeout = time.Second
	_, err := d.DialService(context.Background(), "root", "default", "echo", 80)
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "no tunnel broker reachable within") ||
		!strings.Contains(err.Error(), "connection refused") {
		t.Errorf("dial with the broker down: %v, want Unavailable: no tunnel broker reachable within ...: connection refused", err)
	}
	noAddress(t, "dial with the broker down", err)

	_, addr := env.StartBrokerProcess()
	echo := harness.StartEcho(t)
	agent := env.StartAgentProcess(addr, "/agent/sync-target-1", echoServices(echo))
	conn, err := dialEchoConn(env.Dialer(addr, "/kcp"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.Write([]byte("ping\n")); err != nil {
		t.Fatal(err)
	}
	if _, err := readFull(conn, make([]byte, 5)); err != nil {
		t.Fatal(err)
	}
	agent.Kill()
	conn.SetDeadline(time.Now().Add(20 * time.Second))
	_, err = conn.Read(make([]byte, 1))
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "tunnel lost on the agent's side: the agent") ||
		!strings.Contains(err.Error(), "(tunnel ") {
		t.Errorf("read after the agent stopped: %v, want Unavailable: tunnel lost on the agent's side, in words, with the tunnel's id", err)
	}
	noAddress(t, "read after the agent stopped", err)
}

func noAddress(t *testing.T, what string, err error) {
	t.Helper()
	if err != nil && (strings.Contains(err.Error(), "127.0.0.1") || strings.Contains(err.Error(), "tcp ")) {
		t.Errorf("%s: %v names an address", what, err)
	}
}
