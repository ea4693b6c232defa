package main

import (
	"fmt"
	"math"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"
)

// report prints the table: one row per figure, as it is measured, to stdout.
type report struct{}

// none marks a value that does not apply.
var none = math.NaN()

// row prints a figure. The ratio is tunneled/direct, or "-" without both.
func (rep *report) row(name string, direct, tunneled float64) {
	rep.line(name, "tunneled", direct, tunneled)
}

// relayRow prints figure name of the relay path (relay.go) against the
// direct path, as "relay_<name>" with a relay= column in the place of
// tunneled=; the ratio is relay/direct.
func (rep *report) relayRow(name string, direct, relay float64) {
	rep.floorRow("relay", name, direct, relay)
}

// floorRow prints figure name of a reference path (the relay, the gRPC
// floor) against the direct path, as "<path>_<name>" with a <path>= column
// in the place of tunneled=; the ratio is path/direct.
func (rep *report) floorRow(path, name string, direct, value float64) {
	rep.line(path+"_"+name, path, direct, value)
}

// pathRow prints figure name of path against the direct path: as row for
// the tunnel, and as floorRow for the other paths.
func (rep *report) pathRow(path, name string, direct, value float64) {
	if path == "tunneled" {
		rep.row(name, direct, value)
		return
	}
	rep.floorRow(path, name, direct, value)
}

// hostileRow prints a figure of the hostile phase: the broker under
// attack, with no direct path to compare with.
func (rep *report) hostileRow(name string, value float64) {
	rep.line(name, "hostile", none, value)
}

// line prints one figure of path against the direct path. A name longer
// than its column takes from the direct value's padding, and the path's
// label from its value's, so that the later columns stay aligned.
func (*report) line(name, path string, direct, value float64) {
	ratio := none
	if !math.IsNaN(direct) && !math.IsNaN(value) && direct != 0 {
		ratio = value / direct
	}
	w := max(44, len(name))
	fmt.Printf("%-*s direct=%-*s %s=%-*s ratio=%s\n", w, name, max(1, 44+8-w), num(direct), path, max(1, 16-len(path)), num(value), fixed(ratio, 2))
}

// note prints a comment line: scripts skip lines starting with #.
func (*report) note(format string, args ...any) {
	fmt.Printf("# "+format+"\n", args...)
}

// num formats v with three significant digits, at least the integer part.
func num(v float64) string {
	switch a := math.Abs(v); {
	case math.IsNaN(v):
		return "-"
	case a >= 100:
		return fixed(v, 0)
	case a >= 10:
		return fixed(v, 1)
	case a >= 1:
		return fixed(v, 2)
	default:
		return fixed(v, 3)
	}
}

func fixed(v float64, prec int) string {
	if math.IsNaN(v) {
		return "-"
	}
	return strconv.FormatFloat(v, 'f', prec, 64)
}

func (rep *report) header(r *runner) {
	rep.note("tunnelbench: direct loopback vs kcpplugin -> broker -> syncer-agent, SPIFFE mTLS on both legs")
	if r.relay != nil {
		rep.note("relay_* rows: caller -mTLS-> relay 1 -mTLS-> relay 2 -TCP-> target, two child processes copying with io.Copy, one TLS connection per connection; relay= is that path, ratio relay/direct")
	}
	if r.cfg.peerBin != "" {
		rep.note("%s_* rows: caller -CONNECT over a Unix socket-> remotedialer server -websocket/mTLS-> remotedialer client -TCP-> target, two child processes (%s); %s= is that path, ratio %s/direct", peerName, peerVersion(r.cfg.peerBin), peerName, peerName)
	}
	if r.hops != nil {
		rep.note("hop-delay=%v: every connection between two processes of every path (TCP, and the CONNECT fronts' Unix sockets) crosses a relay holding each chunk %v each way, and a new connection's first bytes a handshake's round trip more; the relays are a child process whose CPU no figure includes; phases %s left out", r.hops.delay, r.hops.delay, strings.Join(undelayedPhases, ", "))
	}
	if slices.Contains(r.cfg.phases, "grpc") {
		rep.note("grpc_* rows: one gRPC stream between two processes, a child echoing over SPIFFE mTLS with the broker's transport settings; grpc= is that path, ratio grpc/direct")
	}
	rep.note("machine: nproc=%d model=%q mem=%s kernel=%s go=%s", runtime.NumCPU(), cpuModel(), memTotal(), osRelease(), runtime.Version())
	rep.note("commit: %s", commit())
	rep.note("load at start: %s", loadAvg())
	pprof := "no (binaries lack --pprof-listen: goroutine figures and process profiles skipped)"
	if r.pprof {
		pprof = "yes"
	}
	rep.note("pprof endpoints: %s", pprof)
	c := r.cfg
	hopDelay := "off"
	if c.hopDelay > 0 {
		hopDelay = "on," + c.hopDelay.String()
	}
	rep.note("trace=%v: kcpplugin, the broker and the agent send every dial's spans by OTLP to a receiver in this process (off: tracing off, as by default)", c.trace)
	rep.note("config: hop-delay=%s size=%s duration=%v conns=%d dials=%d paced-dials=%d paced-pause=%v idle=%v flood=%s webhook-conns=%d phases=%s relay=%v peer-remotedialer=%v hostile-streams=%d hostile-message=%d hostile-frame=%d hostile-pad=%d hostile-tunnels=%d",
		hopDelay, bytesString(c.size), c.duration, c.conns, c.dials, c.pacedDials, c.pacedPause, c.idle, bytesString(c.flood), c.webhookConns, strings.Join(c.phases, ","), r.relay != nil, c.peerBin != "",
		c.hostileStreams, c.hostileMessage, c.hostileFrame, c.hostilePad, c.hostileTunnels)
	if slices.Contains(c.phases, "hostile") {
		rep.note("hostile_* rows: a fresh broker, and streams from one identity that never send a whole first message, or tunnels of one agent (hostile_tunnel_*); hostile= is the figure")
	}
}

func (rep *report) footer(r *runner) {
	rep.note("load at end: %s", loadAvg())
	if r.hops != nil {
		rep.note("hop relays: %v of CPU over the run, in no figure", r.hops.cpu().Round(time.Millisecond))
	}
	if r.cfg.trace {
		rep.note("%s", r.spansReceived())
	}
	rep.note("took %v", time.Since(r.started).Round(time.Second))
}

func bytesString(n int64) string {
	switch {
	case n >= 1<<30 && n%(1<<30) == 0:
		return fmt.Sprintf("%dGiB", n>>30)
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%dMiB", n>>20)
	}
	return fmt.Sprint(n)
}

// loadAvg is the first three fields of /proc/loadavg, as uptime shows them.
func loadAvg() string {
	raw, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(raw))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ")
}

func cpuModel() string {
	raw, _ := os.ReadFile("/proc/cpuinfo")
	for _, line := range strings.Split(string(raw), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return "unknown"
}

func memTotal() string {
	raw, _ := os.ReadFile("/proc/meminfo")
	for _, line := range strings.Split(string(raw), "\n") {
		if v, ok := strings.CutPrefix(line, "MemTotal:"); ok {
			f := strings.Fields(v)
			if kib, err := strconv.ParseInt(f[0], 10, 64); err == nil {
				return fmt.Sprintf("%.1fGiB", float64(kib)/(1<<20))
			}
		}
	}
	return "unknown"
}

func osRelease() string {
	raw, _ := os.ReadFile("/proc/sys/kernel/osrelease")
	if s := strings.TrimSpace(string(raw)); s != "" {
		return s
	}
	return "unknown"
}

// commit is the checked-out commit, marked dirty when the tree has changes
// (the binaries are built from the tree as it is).
func commit() string {
	out, err := exec.Command("git", "describe", "--always", "--dirty").Output()
	if err != nil {
		return "unknown"
	}
	return strings.TrimSpace(string(out))
}
