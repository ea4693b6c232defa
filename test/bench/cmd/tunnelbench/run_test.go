package main

import (
	"bufio"
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// rowPattern is one figure of the table: name, direct value, path and its
// value, ratio; "-" where a value does not apply.
var rowPattern = regexp.MustCompile(`^(\S+) +direct=(\S+) +(tunneled|relay|grpc|hostile|peer_remotedialer|early|connect)=(\S+) +ratio=(\S+)$`)

// TestTinyRunPrintsEveryFigure runs make bench's tool on tiny sizes, every
// phase with the real binaries and the remotedialer peer, and checks the
// table a script would read: each line a figure, each phase's figures there
// with values. It asserts no figure's size: these machines are shared and
// noisy.
func TestTinyRunPrintsEveryFigure(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the brokers, agents, peer and children for about a minute and a half")
	}
	out := runTiny(t)
	values := figures(t, out)
	// One figure or more of each phase, each path; the tunnel's figures
	// must be numbers.
	for _, name := range tinyRunFigures {
		v, ok := values[name]
		if !ok {
			t.Errorf("no %s row", name)
			continue
		}
		if _, err := strconv.ParseFloat(v, 64); err != nil {
			t.Errorf("%s: value %q is not a number", name, v)
		}
	}
	// The one figure with a required value (issue 16): during the rolling
	// restart, no dial to a cluster whose agent was registered failed.
	if v := values["scale_restart_dials_failed_agent_registered"]; v != "0.000" {
		t.Errorf("scale_restart_dials_failed_agent_registered = %s, want 0: a dial failed while its agent was registered", v)
	}
	if t.Failed() {
		t.Logf("output:\n%s", out)
	}
}

// tinyRunFigures are one figure or more of each phase and each path, which
// a tiny run must print with a number.
var tinyRunFigures = []string{
	"throughput_download_MiBps", "throughput_upload_cpu_s_per_GiB", "relay_throughput_upload_MiBps",
	"rtt64_p50_us", "rtt64_broker_cpu_us_per_rt", "relay_rtt64_added_p50_us",
	"rtt64_4conns_per_s", "dial_p99_us", "relay_handshake_p50_us",
	"grpc_rtt64_p50_us", "grpc_new_stream_rtt64_p99_us",
	"isolation_slowdown_p50", "tenants_dial_loaded_p50_us", "tenants_dial_loaded_failed", "webhook_1conn_per_s", "webhook_4conns_p99_us",
	"connect_webhook_1conn_per_s", "connect_webhook_4conns_per_s",
	"idle_20_broker_rss_KiB_per_tunnel", "idle_20_broker_goroutines_per_tunnel",
	"hostile_dial_most_broker_rss_MiB_peak", "hostile_connect_most_streams_not_ended",
	"hostile_tunnel_unfinished_broker_rss_MiB_peak", "hostile_tunnel_stalled_small_MiB_sent_per_tunnel",
	// Every path's new-connection figures, and the peer's of each phase.
	"dial_first_echo_p50_us", "relay_dial_2handshakes_first_echo_p99_us", "throughput_upload_middle_cpu_s_per_GiB",
	"paced_dial_first_echo_p50_us", "early_paced_dial_first_echo_p99_us", "connect_paced_dial_first_echo_p50_us",
	"paced_dial_first_echo_agent_cpu_us",
	"peer_remotedialer_paced_dial_first_echo_p50_us", "peer_remotedialer_paced_dial_first_echo_middle_cpu_us",
	"peer_remotedialer_paced_dial_first_echo_failed",
	"webhook_dial_tls_first_request_p50_us", "relay_webhook_dial_tls_first_request_p99_us",
	"early_dial_first_echo_p50_us", "early_webhook_dial_tls_first_request_p99_us", "dial_first_echo_broker_cpu_us",
	"connect_rtt64_p50_us", "connect_rtt64_broker_cpu_us_per_rt", "connect_rtt64_4conns_per_s", "connect_dial_first_echo_p99_us",
	"idle_20_middle_rss_KiB_per_tunnel",
	"peer_remotedialer_throughput_download_MiBps", "peer_remotedialer_throughput_upload_middle_cpu_s_per_GiB",
	"peer_remotedialer_rtt64_p99_us", "peer_remotedialer_rtt64_server_cpu_us_per_rt", "peer_remotedialer_rtt64_4conns_per_s",
	"peer_remotedialer_dial_first_echo_p50_us", "peer_remotedialer_dial_first_echo_middle_cpu_us", "peer_remotedialer_dial_first_echo_failed",
	"peer_remotedialer_webhook_dial_tls_first_request_failed", "peer_remotedialer_isolation_slowdown_p50",
	"peer_remotedialer_webhook_4conns_per_s", "peer_remotedialer_webhook_dial_tls_first_request_p50_us",
	"peer_remotedialer_idle_20_server_rss_KiB_per_tunnel", "peer_remotedialer_idle_20_client_goroutines_per_tunnel",
	"peer_remotedialer_idle_20_middle_rss_KiB_per_tunnel",
	"scale_register_all_s", "scale_broker_rss_KiB_per_agent", "scale_broker_goroutines_per_agent", "scale_metrics_series",
	"scale_idle_wire_B_per_s_per_agent", "scale_dial_p99_us", "scale_reregister_4_routed_ms", "scale_reregister_300_broker_cpu_ms",
	"scale_restart_dials", "scale_restart_dials_failed_agent_registered", "scale_vanish_dials_failed_agent_registered",
}

// runTiny builds tunnelbench and the remotedialer peer, runs every phase
// on tiny sizes with the real binaries, and returns the table it printed.
func runTiny(t *testing.T) []byte {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "tunnelbench")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("building tunnelbench: %v\n%s", err, out)
	}
	// Cold, this downloads the peer's Go toolchain and builds it: about a
	// minute on 2 cores, once per machine (see build.sh).
	peer, err := exec.Command("sh", "../../peers/remotedialer/build.sh").Output()
	if err != nil {
		t.Fatalf("building the remotedialer peer: %v\n%s", err, stderrOf(err))
	}
	cmd := exec.Command(bin, "-size", "8MiB", "-duration", "300ms", "-dials", "30", "-paced-dials", "5", "-paced-pause", "5ms", "-idle", "20",
		"-conns", "4", "-webhook-conns", "4", "-flood", "64MiB",
		"-hostile-streams", "20", "-hostile-tunnels", "2", "-hostile-wait", "20s",
		"-peer-remotedialer", strings.TrimSpace(string(peer)),
		"-scale-agents", "20", "-scale-clusters", "4", "-scale-big", "300", "-scale-dials", "20", "-scale-reregisters", "20",
		"-scale-big-reregisters", "2", "-scale-idle", "1s", "-scale-restart", "2s", "-scale-vanish", "2", "-scale-vanish-watch", "1s")
	cmd.Env = append(os.Environ(), "TUNNEL_BIN_DIR="+harness.Binaries(t))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("tunnelbench: %v\n%s", err, stderr.String())
	}
	return out
}

// figures reads the table a script would: each line not a comment must be
// a figure; it returns each figure's value of its path.
func figures(t *testing.T, out []byte) map[string]string {
	t.Helper()
	values := map[string]string{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		line := sc.Text()
		if len(line) == 0 || line[0] == '#' {
			continue
		}
		m := rowPattern.FindStringSubmatch(line)
		if m == nil {
			t.Errorf("not a figure line: %q", line)
			continue
		}
		values[m[1]] = m[4]
	}
	return values
}

// stderrOf is what a command that failed wrote to stderr, if it was kept.
func stderrOf(err error) []byte {
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		return exit.Stderr
	}
	return nil
}
