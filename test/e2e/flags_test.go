package e2e

import (
	"bytes"
	"errors"
	"net"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// The binaries' flags mean what they say, on the built binaries: a mistake
// is one line saying what, and one pointing at --help (exit code 2);
// --help and tunnelctl's help exit 0; a port taken names its flag.

// runBinary runs a built binary to its end and returns its stdout, its
// stderr and its exit code.
func runBinary(t *testing.T, name string, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	var out, errOut bytes.Buffer
	cmd := exec.Command(filepath.Join(harness.Binaries(t), name), args...)
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	var exit *exec.ExitError
	switch {
	case errors.As(err, &exit):
		code = exit.ExitCode()
	case err != nil:
		t.Fatalf("%s %v: %v", name, args, err)
	}
	return out.String(), errOut.String(), code
}

// brokerArgs are the flags a broker needs to start, with env's identity.
func brokerArgs(env *harness.Env) []string {
	f := env.SVID("/broker")
	return []string{"--policy", env.WritePolicy(nil), "--listen", "127.0.0.1:0", "--metrics-listen", "",
		"--svid-cert", f.Cert, "--svid-key", f.Key, "--trust-bundle", f.Bundle}
}

func TestMisconfigFlagMistakeIsOneLineAndAPointerToHelp(t *testing.T) {
	env := harness.NewEnv(t)
	for _, tc := range []struct {
		binary string
		args   []string
		first  string // the first line on stderr
		help   string // the command the second line points at
	}{
		{"broker", []string{"--listne", ":8443"}, "broker: flag provided but not defined: -listne", "broker --help"},
		{"broker", []string{"--dial-timeout", "soon"}, `broker: invalid value "soon" for flag -dial-timeout: parse error`, "broker --help"},
		{"broker", append(brokerArgs(env), "--idle-timeout", "0"), "broker: --idle-timeout 0s: must be positive (negative: never)", "broker --help"},
		{"broker", append(brokerArgs(env), "--window-size", "1024"), "broker: --window-size 1024: below 65535, HTTP/2's initial window, gRPC would ignore it", "broker --help"},
		{"broker", append(brokerArgs(env), "--egress-uds", "/tmp/egress.sock"), "broker: --egress-uds /tmp/egress.sock needs --egress-uds-cluster", "broker --help"},
		{"broker", append(brokerArgs(env), "--egress-uds-cluster", "root"), "broker: --egress-uds-cluster root needs --egress-uds", "broker --help"},
		{"broker", []string{"--listen", "127.0.0.1:0"}, "broker: --policy is required", "broker --help"},
		{"syncer-agent", []string{"--brokr", "127.0.0.1:8443"}, "syncer-agent: flag provided but not defined: -brokr", "syncer-agent --help"},
		{"syncer-agent", []string{"--broker", "127.0.0.1:8443", "--services", "s.yaml"}, "syncer-agent: --name is required", "syncer-agent --help"},
		{"syncer-agent", []string{"--broker", "localhost", "--name", "a", "--services", "s.yaml"},
			"syncer-agent: --broker localhost: no port: give HOST:PORT, e.g. localhost:8443", "syncer-agent --help"},
		{"syncer-agent", []string{"--broker-dns", "broker.svc", "--name", "a", "--services", "s.yaml"}, "syncer-agent: --broker-dns broker.svc: no port", "syncer-agent --help"},
		{"syncer-agent", []string{"--broker", "127.0.0.1:8443", "--name", "a"}, "syncer-agent: give --services FILE", "syncer-agent --help"},
		{"tunnelctl", []string{"--brokr", "x"}, "tunnelctl: flag provided but not defined: -brokr", "tunnelctl --help"},
		{"tunnelctl", nil, "tunnelctl: no command", "tunnelctl --help"},
		{"tunnelctl", []string{"agent"}, `tunnelctl: unknown command "agent"`, "tunnelctl --help"},
		{"tunnelctl", []string{"--broker", "localhost", "agents"}, "tunnelctl: --broker localhost: no port: give HOST:PORT", "tunnelctl --help"},
		{"tunnelctl", []string{"agents", "--clustr", "root"}, "tunnelctl: flag provided but not defined: -clustr", "tunnelctl agents --help"},
		{"tunnelctl", []string{"tunnels", "--limit", "0"}, "tunnelctl: --limit 0: must be positive", "tunnelctl tunnels --help"},
		{"tunnelctl", []string{"dial", "root", "default", "web"}, "tunnelctl: dial takes CLUSTER NAMESPACE SERVICE PORT, not 3 arguments", "tunnelctl dial --help"},
		{"tunnelctl", []string{"dev-ca"}, "tunnelctl: dev-ca takes one argument", "tunnelctl dev-ca --help"},
	} {
		stdout, stderr, code := runBinary(t, tc.binary, tc.args...)
		lines := strings.Split(strings.TrimSuffix(stderr, "\n"), "\n")
		if code != 2 || stdout != "" || len(lines) != 2 || !strings.HasPrefix(lines[0], tc.first) || lines[1] != "Run '"+tc.help+"' for usage." {
			t.Errorf("%s %v: exit %d, stdout %q, stderr:\n%s\nwant exit 2, nothing on stdout, and on stderr %q... and a line pointing at %s",
				tc.binary, tc.args, code, stdout, stderr, tc.first, tc.help)
		}
	}
}

func TestMisconfigHelpExitsZero(t *testing.T) {
	for _, tc := range []struct {
		binary string
		args   []string
		want   []string // on stdout
	}{
		{"broker", []string{"--help"}, []string{"broker: the kcp tunnel broker", "Usage:", "-window-size", "65535 to 134217727", "-idle-timeout"}},
		{"broker", []string{"-h"}, []string{"broker: the kcp tunnel broker"}},
		{"syncer-agent", []string{"--help"}, []string{"syncer-agent: registers", "-name", "required"}},
		{"tunnelctl", []string{"--help"}, []string{"tunnelctl talks to a tunnel broker", "tunnelctl help [COMMAND]", "-broker"}},
		{"tunnelctl", []string{"help"}, []string{"tunnelctl talks to a tunnel broker", "-svid-cert"}},
		{"tunnelctl", []string{"help", "tunnels"}, []string{"tunnelctl [flags] tunnels", "-limit", "tunnelctl --help"}},
		{"tunnelctl", []string{"tunnels", "--help"}, []string{"tunnelctl [flags] tunnels", "-limit"}},
		{"tunnelctl", []string{"agents", "-h"}, []string{"tunnelctl [flags] agents", "-cluster"}},
		{"tunnelctl", []string{"dial", "--help"}, []string{"tunnelctl [flags] dial CLUSTER NAMESPACE SERVICE PORT"}},
		{"tunnelctl", []string{"port-forward", "--help"}, []string{"tunnelctl [flags] port-forward LOCALPORT"}},
		{"tunnelctl", []string{"dev-ca", "--help"}, []string{"tunnelctl dev-ca [--trust-domain NAME] DIR", "-trust-domain"}},
		{"tunnelctl", []string{"help", "dev-ca"}, []string{"tunnelctl dev-ca [--trust-domain NAME] DIR"}},
	} {
		stdout, stderr, code := runBinary(t, tc.binary, tc.args...)
		if code != 0 || stderr != "" {
			t.Errorf("%s %v: exit %d, stderr %q; want exit 0 and the usage on stdout", tc.binary, tc.args, code, stderr)
		}
		for _, w := range tc.want {
			if !strings.Contains(stdout, w) {
				t.Errorf("%s %v: stdout does not say %q:\n%s", tc.binary, tc.args, w, stdout)
			}
		}
	}
}

// A port another process holds fails the start, naming the flag that chose
// it.
func TestMisconfigTakenPortNamesItsFlag(t *testing.T) {
	env := harness.NewEnv(t)
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	addr := taken.Addr().String()
	agentF := env.SVID("/agent/sync-target-1")
	agentArgs := []string{"--broker", "127.0.0.1:1", "--name", "a", "--services", writeServices(t), "--metrics-listen", "",
		"--svid-cert", agentF.Cert, "--svid-key", agentF.Key, "--trust-bundle", agentF.Bundle}
	for _, tc := range []struct {
		binary string
		args   []string
		flag   string
	}{
		{"broker", append(brokerArgs(env), "--listen", addr), "--listen"},
		{"broker", append(brokerArgs(env), "--metrics-listen", addr), "--metrics-listen"},
		{"broker", append(brokerArgs(env), "--pprof-listen", addr), "--pprof-listen"},
		{"broker", append(brokerArgs(env), "--egress-listen", addr), "--egress-listen"},
		{"syncer-agent", append(agentArgs, "--metrics-listen", addr), "--metrics-listen"},
		{"syncer-agent", append(agentArgs, "--pprof-listen", addr), "--pprof-listen"},
	} {
		out := refusedAtStart(t, tc.binary, tc.args...)
		wantIn(t, out, tc.flag+": listen tcp "+addr+": bind: address already in use")
	}
}

func writeServices(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "services.yaml")
	writeFile(t, path, "services:\n- {cluster: root, namespace: default, name: echo, ports: {\"80\": \"127.0.0.1:1\"}}\n")
	return path
}

// tunnelctl counts in words, says when --limit cut the list, and an
// invalid --cluster filter is an error, not an empty list.
func TestTunnelctlCountsLimitsAndRefusesABadFilter(t *testing.T) {
	env := harness.NewEnv(t)
	_, addr := env.StartBrokerProcess("--id", "broker-a")
	env.StartAgentProcess(addr, "/agent/sync-target-1", echoServices(harness.StartEcho(t)))
	first := openEchoTunnel(t, env, addr)
	roundTrip(t, first, "hello")

	for _, tc := range []struct {
		args   []string
		header string
		rows   int
	}{
		{[]string{"agents"}, "broker replica broker-a: 1 agent", 1},
		{[]string{"tunnels"}, "broker replica broker-a: 1 tunnel", 1},
	} {
		out, err := tunnelctl(t, env, addr, "/operator", tc.args...).CombinedOutput()
		lines := strings.Split(strings.TrimSpace(string(out)), "\n")
		if err != nil || lines[0] != tc.header || len(lines) != 2+tc.rows {
			t.Errorf("tunnelctl %v: %v\n%s\nwant %q and %d rows", tc.args, err, out, tc.header, tc.rows)
		}
	}

	second := openEchoTunnel(t, env, addr)
	roundTrip(t, second, "x")
	out, err := tunnelctl(t, env, addr, "/operator", "tunnels", "--limit", "1").CombinedOutput()
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if want := "broker replica broker-a: 1 tunnel (more are open: --limit 1 cut the list)"; err != nil || lines[0] != want || len(lines) != 3 {
		t.Errorf("tunnelctl tunnels --limit 1 with 2 open: %v\n%s\nwant %q and one row", err, out, want)
	}

	for _, cmd := range []string{"agents", "tunnels"} {
		out, err := tunnelctl(t, env, addr, "/operator", cmd, "--cluster", "root:org").CombinedOutput()
		if err == nil || !bytes.Contains(out, []byte("InvalidArgument")) || !bytes.Contains(out, []byte("not a valid logical cluster name")) {
			t.Errorf("tunnelctl %s --cluster root:org: %v\n%s\nwant InvalidArgument, not an empty list", cmd, err, out)
		}
	}
}
