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
	"time"

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
	// The figures with a required value (issue 16): during the rolling
	// restart, no dial to a cluster whose agent was registered failed.
	// The same when every agent returns to a replica that restarted.
	for _, name := range []string{"scale_restart_dials_failed_agent_registered", "scale_return_dials_failed_agent_registered"} {
		if v := values[name]; v != "0.000" {
			t.Errorf("%s = %s, want 0: a dial failed while its agent was registered", name, v)
		}
	}
	if t.Failed() {
		t.Logf("output:\n%s", out)
	}
}

// TestTinyRunWithHopDelay runs make bench-latency's phases (and the
// throughput, rps and grpc ones) on tiny sizes with -hop-delay, and checks
// that the run says so and prints its figures, each at least the delays its
// hops add up to: a lower bound only, which a path that skipped one of its
// relays would miss (the delay is long enough next to loopback's costs).
func TestTinyRunWithHopDelay(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the brokers, agents, peer and children for about half a minute")
	}
	const delay = 2 * time.Millisecond
	out := runTunnelbench(t, "-hop-delay", delay.String(), "-phases", "throughput,latency,rps,dial,grpc,webhook",
		"-size", "8MiB", "-duration", "300ms", "-dials", "10", "-conns", "4", "-webhook-conns", "4")
	if !bytes.Contains(out, []byte("# config: hop-delay=on,"+delay.String()+" ")) {
		t.Errorf("no config line with hop-delay=on,%v", delay)
	}
	direct, values := columns(t, out)
	for _, f := range hopDelayFigures {
		column := values
		if f.direct {
			column = direct
		}
		v, ok := column[f.name]
		if !ok {
			t.Errorf("no %s row", f.name)
			continue
		}
		us, err := strconv.ParseFloat(v, 64)
		if err != nil {
			t.Errorf("%s: value %q is not a number", f.name, v)
			continue
		}
		if want := float64(f.hops) * float64(delay.Microseconds()); us < want {
			t.Errorf("%s (direct: %v) = %sµs, under %d hops of %v: a hop not delayed", f.name, f.direct, v, f.hops, delay)
		}
	}
	for _, name := range []string{"throughput_download_MiBps", "relay_throughput_upload_MiBps", "peer_remotedialer_rtt64_4conns_per_s", "grpc_new_stream_rtt64_p50_us"} {
		if _, ok := values[name]; !ok {
			t.Errorf("no %s row", name)
		}
	}
	if t.Failed() {
		t.Logf("output:\n%s", out)
	}
}

// hopDelayFigures are figures of a run with -hop-delay and how many hops
// (one way) each crosses at least: of the direct path's value (direct), or
// of the row's path. A new connection's handshake counts as a round trip.
var hopDelayFigures = []struct {
	name   string
	direct bool
	hops   int
}{
	{"rtt64_p50_us", true, 2}, {"rtt64_p50_us", false, 6}, {"relay_rtt64_p50_us", false, 6},
	{"peer_remotedialer_rtt64_p50_us", false, 6}, {"connect_rtt64_p50_us", false, 6},
	{"grpc_rtt64_p50_us", false, 2},
	{"dial_p50_us", false, 4}, {"dial_first_echo_p50_us", true, 4}, {"dial_first_echo_p50_us", false, 6},
	{"early_dial_first_echo_p50_us", false, 6}, {"peer_remotedialer_dial_first_echo_p50_us", false, 6},
	{"webhook_1conn_p50_us", true, 2}, {"webhook_1conn_p50_us", false, 6},
	{"peer_remotedialer_webhook_1conn_p50_us", false, 6}, {"connect_webhook_1conn_p50_us", false, 6},
	{"webhook_dial_tls_first_request_p50_us", true, 6}, {"webhook_dial_tls_first_request_p50_us", false, 12},
	{"early_webhook_dial_tls_first_request_p50_us", false, 12}, {"relay_webhook_dial_tls_first_request_p50_us", false, 12},
	{"peer_remotedialer_webhook_dial_tls_first_request_p50_us", false, 12},
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
	"scale_return_all_s", "scale_return_broker_cpu_ms_per_agent", "scale_return_dials_failed_agent_registered",
}

// runTiny builds tunnelbench and the remotedialer peer, runs every phase
// on tiny sizes with the real binaries, and returns the table it printed.
func runTiny(t *testing.T) []byte {
	t.Helper()
	return runTunnelbench(t, "-size", "8MiB", "-duration", "300ms", "-dials", "30", "-paced-dials", "5", "-paced-pause", "5ms", "-idle", "20",
		"-conns", "4", "-webhook-conns", "4", "-flood", "64MiB",
		"-hostile-streams", "20", "-hostile-tunnels", "2", "-hostile-wait", "20s",
		"-scale-agents", "20", "-scale-clusters", "4", "-scale-big", "300", "-scale-dials", "20", "-scale-reregisters", "20",
		"-scale-big-reregisters", "2", "-scale-idle", "1s", "-scale-restart", "2s", "-scale-vanish", "2", "-scale-vanish-watch", "1s")
}

// runTunnelbench builds tunnelbench and the remotedialer peer, runs it with
// the peer, the real binaries and args, and returns the table it printed.
func runTunnelbench(t *testing.T, args ...string) []byte {
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
	cmd := exec.Command(bin, append([]string{"-peer-remotedialer", strings.TrimSpace(string(peer))}, args...)...)
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
	_, values := columns(t, out)
	return values
}

// columns is figures, with each figure's direct value too.
func columns(t *testing.T, out []byte) (direct, values map[string]string) {
	t.Helper()
	direct, values = map[string]string{}, map[string]string{}
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
		direct[m[1]], values[m[1]] = m[2], m[4]
	}
	return direct, values
}

// stderrOf is what a command that failed wrote to stderr, if it was kept.
func stderrOf(err error) []byte {
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		return exit.Stderr
	}
	return nil
}
