package e2e

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// These tests make the mistakes people make when they run the parts by
// hand, and check that the side that made each one says so, in words that
// name the flag or the file, and that nothing waits silently.

// refusedAtStart runs a binary that must refuse to start, and returns what
// it printed.
func refusedAtStart(t *testing.T, name string, args ...string) string {
	t.Helper()
	p := harness.StartProcess(t, name, args...)
	if err := p.Exited(t, 30*time.Second); err == nil {
		t.Fatalf("%s %s started; want it refused:\n%s", name, strings.Join(args, " "), p.Output())
	}
	return p.Output()
}

func wantIn(t *testing.T, output string, parts ...string) {
	t.Helper()
	for _, part := range parts {
		if !strings.Contains(output, part) {
			t.Errorf("output does not say %q:\n%s", part, output)
		}
	}
}

func TestMissingSVIDFileNamesItsFlag(t *testing.T) {
	env := harness.NewEnv(t)
	f := env.SVID("/broker")
	out := refusedAtStart(t, "broker", "--policy", env.WritePolicy(nil), "--listen", "127.0.0.1:0", "--metrics-listen", "",
		"--svid-cert", "nope.crt", "--svid-key", f.Key, "--trust-bundle", f.Bundle)
	wantIn(t, out, "--svid-cert: open nope.crt: no such file or directory")
}

func TestTrustBundleWithoutCAIsRefused(t *testing.T) {
	env := harness.NewEnv(t)
	f := env.SVID("/agent/sync-target-1")
	// The SVID itself given as the bundle: a leaf, no CA.
	// --services is never read: the identity fails first.
	out := refusedAtStart(t, "syncer-agent", "--broker", "127.0.0.1:1", "--name", "a", "--metrics-listen", "", "--services", "services.yaml",
		"--svid-cert", f.Cert, "--svid-key", f.Key, "--trust-bundle", f.Cert)
	wantIn(t, out, "--trust-bundle "+f.Cert+": holds no CA certificate, only spiffe://tunnel.test/agent/sync-target-1")
}

func TestKeyNotPKCS8SaysHowToConvertIt(t *testing.T) {
	env := harness.NewEnv(t)
	f := env.SVID("/broker")
	// What openssl ecparam -genkey writes.
	ecKey := filepath.Join(t.TempDir(), "ec.key")
	writeECKey(t, ecKey)
	out := refusedAtStart(t, "broker", "--policy", env.WritePolicy(nil), "--metrics-listen", "",
		"--svid-cert", f.Cert, "--svid-key", ecKey, "--trust-bundle", f.Bundle)
	wantIn(t, out, "--svid-key "+ecKey, "openssl pkcs8 -topk8 -nocrypt")
}

// A Workload API that is not there: the binary says where it waits, its
// /readyz says why it is not ready, and it gives up after the bound with
// the flag named.
func TestWorkloadAPIThatIsNotThere(t *testing.T) {
	socket := "unix://" + filepath.Join(t.TempDir(), "agent.sock")
	env := harness.NewEnv(t)
	waiting := harness.StartProcess(t, "broker", "--policy", env.WritePolicy(nil), "--listen", "127.0.0.1:0",
		"--metrics-listen", "127.0.0.1:0", "--spiffe-socket", socket, "--workload-api-timeout", "10m")
	waiting.WaitLogged(t, 1, "waiting for an X.509-SVID from the SPIFFE Workload API", socket)
	resp, err := http.Get("http://" + waiting.MetricsAddr(t) + "/readyz")
	if err != nil {
		t.Fatalf("/readyz while waiting for the SVID: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(body), "waiting for the broker's X.509-SVID") {
		t.Errorf("/readyz while waiting for the SVID: %d %q, want 503 saying why", resp.StatusCode, body)
	}
	waiting.WaitLogged(t, 1, "Workload API: ", "no such file or directory")

	out := refusedAtStart(t, "syncer-agent", "--broker", "127.0.0.1:1", "--name", "a", "--metrics-listen", "", "--services", "services.yaml",
		"--spiffe-socket", socket, "--workload-api-timeout", "2s")
	wantIn(t, out, "no X.509-SVID from the Workload API at "+socket+" within 2s (--workload-api-timeout)", "no such file or directory")
}

// An agent that refuses the broker's SVID says what it was shown and what
// it expected; the broker says the refusal was its peer's.
func TestAgentRefusingTheBrokerSaysWhatItExpected(t *testing.T) {
	env := harness.NewEnv(t)
	broker, addr := env.StartBrokerProcess()
	agent := env.RunAgentProcess(addr, "sync-target-1", env.SVID("/agent/sync-target-1"), lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: "root", Namespace: "default", Name: "echo", Ports: map[string]string{"80": "127.0.0.1:1"}},
	}}, "--broker-spiffe-id", "spiffe://tunnel.test/not-the-broker")
	agent.WaitLogged(t, 1, "TLS handshake refused", "reason=unauthorized",
		"the peer presented spiffe://tunnel.test/broker, but --broker-spiffe-id expects spiffe://tunnel.test/not-the-broker")
	broker.WaitLogged(t, 1, "TLS handshake refused by the peer: its log says why", "reason=refused_by_peer")
}

// writeECKey writes a P-256 key as SEC 1 (-----BEGIN EC PRIVATE KEY-----),
// the form openssl ecparam -genkey writes, which an SVID's key is not.
func writeECKey(t *testing.T, path string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}

// A policy with a misspelt field is refused with the field's path; a rule
// that can never match is logged at start.
func TestBrokerPolicyMistakes(t *testing.T) {
	env := harness.NewEnv(t)
	f := env.SVID("/broker")
	ids := []string{"--svid-cert", f.Cert, "--svid-key", f.Key, "--trust-bundle", f.Bundle, "--metrics-listen", "", "--listen", "127.0.0.1:0"}
	bad := filepath.Join(t.TempDir(), "policy.yaml")
	writeFile(t, bad, "agents:\n- id: spiffe://tunnel.test/agent\n  cluster: [root]\ncallers:\n- id: spiffe://tunnel.test/kcp\n")
	out := refusedAtStart(t, "broker", append([]string{"--policy", bad}, ids...)...)
	wantIn(t, out, "--policy: "+bad+`: agents[0]: unknown field "cluster"`)

	never := filepath.Join(t.TempDir(), "policy.yaml")
	writeFile(t, never, "agents:\n- id: spiffe://tunnel.test/agent/{syncTarget}\ncallers:\n- id: spiffe://tunnel.test/kcp\n")
	p := harness.StartProcess(t, "broker", append([]string{"--policy", never}, ids...)...)
	p.WaitLogged(t, 1, "WARN", "policy rule can never match as written", "syncTargets lists none")
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}

// An agent whose broker is not there says so every 5s, with the last
// connection error (gRPC keeps trying meanwhile, with its backoff), and
// its /readyz says why; each report is counted.
func TestAgentWithoutItsBrokerSaysWhy(t *testing.T) {
	env := harness.NewEnv(t)
	gone := closedPort(t)
	agent := env.RunAgentProcess(gone, "sync-target-1", env.SVID("/agent/sync-target-1"), echoServices("127.0.0.1:1"), "--metrics-listen", "127.0.0.1:0")
	agent.WaitLogged(t, 2, "WARN", "cannot reach the broker, still trying", "broker="+gone, "connection refused", "waited=5s")
	code, body := get(t, "http://"+agent.MetricsAddr(t)+"/readyz")
	if code != http.StatusServiceUnavailable || !strings.Contains(body, gone+": ") || !strings.Contains(body, "connection refused") {
		t.Errorf("/readyz: %d %q, want 503 naming %s and the cause", code, body, gone)
	}
	_, metrics := get(t, "http://"+agent.MetricsAddr(t)+"/metrics")
	if regexp.MustCompile(`(?m)^kcp_tunnel_agent_broker_reconnects_total 0$`).MatchString(metrics) {
		t.Error("the reconnect counter did not count the failed attempts")
	}
}

// An agent the broker's policy refuses logs it as an error that points at
// the policy, and retries slowly.
func TestAgentRefusedByPolicyPointsAtThePolicy(t *testing.T) {
	env := harness.NewEnv(t)
	_, addr := env.StartBrokerProcess()
	agent := env.RunAgentProcess(addr, "stranger", env.SVID("/agent/stranger"), echoServices("127.0.0.1:1"))
	line := agent.WaitLogged(t, 1, "ERROR", "the broker's policy refuses this agent", "--policy", "PermissionDenied", "retry_in=")[0]
	if !strings.Contains(line, "retry_in=") || strings.Contains(line, "retry_in=0s") {
		t.Errorf("no slow retry in %q", line)
	}
	// When, to the millisecond and to the second: no nanoseconds.
	if !regexp.MustCompile(`retry_in=(\d+h)?(\d+m)?\d+(\.\d{1,3})?m?s retry_at=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(Z|[+-]\d\d:\d\d)( |$)`).MatchString(line) {
		t.Errorf("retry_in or retry_at more precise than a person reads: %q", line)
	}
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// Flag values the binaries cannot work with are refused at start, with the
// flag named.
func TestBadFlagsAreRefusedAtStart(t *testing.T) {
	env := harness.NewEnv(t)
	f := env.SVID("/broker")
	base := []string{"--policy", env.WritePolicy(nil), "--listen", "127.0.0.1:0", "--metrics-listen", "",
		"--svid-cert", f.Cert, "--svid-key", f.Key, "--trust-bundle", f.Bundle}
	for _, tc := range []struct {
		binary string
		args   []string
		want   string
	}{
		{"broker", []string{"--max-message-size", "0"}, "--max-message-size 0: must be positive"},
		{"broker", []string{"--dial-timeout", "-1s"}, "--dial-timeout -1s: must not be negative"},
		{"broker", []string{"--max-tunnels-per-caller", "-5"}, "--max-tunnels-per-caller -5: must not be negative"},
		{"broker", []string{"policy.yaml"}, `unexpected argument "policy.yaml": only flags are taken`},
		{"syncer-agent", []string{"--broker", "127.0.0.1:1", "--name", "a", "--resolve-interval", "-30s"}, "--resolve-interval -30s: must not be negative"},
		{"syncer-agent", []string{"--broker", "127.0.0.1:1", "--name", "a", "--svid-reload-interval", "-1s"}, "--svid-reload-interval -1s: must not be negative"},
	} {
		args := tc.args
		if tc.binary == "broker" {
			args = append(append([]string{}, base...), tc.args...)
		}
		wantIn(t, refusedAtStart(t, tc.binary, args...), tc.want)
	}
	help := refusedOrNot(t, "broker", "--help")
	if !strings.HasPrefix(help, "broker: the kcp tunnel broker") || !strings.Contains(help, "required: authorization policy file") {
		t.Errorf("broker --help starts with no synopsis or marks no required flag:\n%s", help)
	}
}

// A repeated --broker adds to the list rather than replacing it.
func TestRepeatedBrokerFlagsAddUp(t *testing.T) {
	env := harness.NewEnv(t)
	f := env.SVID("/agent/sync-target-1")
	agent := env.RunAgentProcess("127.0.0.1:1", "sync-target-1", f, echoServices("127.0.0.1:1"), "--broker", "127.0.0.1:2")
	agent.WaitLogged(t, 1, "agent starting", "brokers=127.0.0.1:1,127.0.0.1:2")
}

// refusedOrNot runs a binary that exits by itself and returns its output.
func refusedOrNot(t *testing.T, name string, args ...string) string {
	t.Helper()
	p := harness.StartProcess(t, name, args...)
	_ = p.Exited(t, 30*time.Second)
	return p.Output()
}

// tunnelctl's hint fits the cause of Unavailable: a broker name that does
// not resolve, nothing listening at the broker's address, a handshake
// refused, no agent for the cluster, a target whose port refuses.
func TestTunnelctlHintsFitTheCause(t *testing.T) {
	env := harness.NewEnv(t)
	_, addr := env.StartBrokerProcess()
	gone := closedPort(t)
	env.StartAgentProcess(addr, "/agent/sync-target-1", echoServices(closedPort(t)))
	for _, tc := range []struct {
		identity  string
		args      []string
		want, not string
	}{
		{"/operator", []string{"--broker", "broker.invalid:8443", "agents"}, "the broker's name in --broker does not resolve", "agent"},
		{"/operator", []string{"--broker", gone, "agents"}, "nothing listens at --broker: is the broker running, and is that its port (its --listen)?", "agent"},
		{"/operator", []string{"--broker", addr, "--broker-spiffe-id", "spiffe://tunnel.test/other", "agents"},
			"the peer presented spiffe://tunnel.test/broker, but --broker-spiffe-id expects spiffe://tunnel.test/other", "agent"},
		{"/kcp", []string{"--broker", addr, "dial", "nowhere", "default", "web", "80"},
			"no agent serves that cluster on this broker replica: is its syncer agent running and registered (tunnelctl agents)?", "not reachable"},
		{"/kcp", []string{"--broker", addr, "dial", "root", "default", "echo", "80"},
			"the agent reached the Service, but its port refused the connection", "is its syncer agent running"},
	} {
		f := env.SVID(tc.identity)
		ids := []string{"--svid-cert", f.Cert, "--svid-key", f.Key, "--trust-bundle", f.Bundle}
		out := refusedAtStart(t, "tunnelctl", append(ids, tc.args...)...)
		wantIn(t, out, tc.want)
		if hint := out[strings.LastIndex(out, "\n  ("):]; strings.Contains(hint, tc.not) {
			t.Errorf("tunnelctl %v hints %q, which is not the cause:\n%s", tc.args, tc.not, out)
		}
	}
}
