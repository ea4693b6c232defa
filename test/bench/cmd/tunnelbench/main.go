// Command tunnelbench measures the tunnel against the direct path, in the
// same run, on loopback: it starts the real broker and syncer-agent binaries
// with SPIFFE mTLS (a throwaway dev trust domain), target servers in this
// process, and kcp's side (kcpplugin.Dialer over one gRPC connection), then
// prints one plain-text row per figure:
//
//	throughput_download_MiBps  direct=980  tunneled=610  ratio=0.62
//
// The ratio is always tunneled/direct (for latencies, lower is better; for
// rates, higher is better); "-" marks a value that does not apply. Rows
// named relay_* measure a reference path instead of the tunnel, in a column
// of its own (relay=, see relay.go); their ratio is relay/direct. Rows
// named peer_remotedialer_* measure a real peer, rancher's remotedialer, the
// same way (peer.go). With -hop-delay, every connection between two
// processes of every path crosses a relay that delays it as a network hop
// would (delayrelay.go). Lines starting with # describe the machine and the
// run. See BENCHMARKS.md for what each figure means. Figures are only
// reported, never judged.
//
// Every phase is bounded in time and the tool stops by itself; `make bench`
// runs it after building the binaries.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// phases, in the order they run.
var allPhases = []string{"throughput", "latency", "rps", "dial", "paced", "grpc", "isolation", "tenants", "webhook", "idle", "hostile", "scale"}

type config struct {
	size         int64         // bytes of each bulk transfer
	duration     time.Duration // of each timed measurement
	conns        int           // connections of the round-trips-per-second figure
	dials        int           // dials per path
	pacedDials   int           // rounds of the paced phase
	pacedPause   time.Duration // after each of them
	idle         []int         // idle tunnel counts
	flood        int64         // bytes the stalled connection of the isolation figure is asked for
	webhookConns int           // concurrent kept-alive connections of the webhook rate figure
	phases       []string
	profileDir   string
	relay        bool          // also measure the relay reference path (relay.go)
	peerBin      string        // if set, also measure the remotedialer peer (peer.go) with this binary
	timeout      time.Duration // bound of one bulk transfer
	hopDelay     time.Duration // if > 0, every hop of every path is delayed this much each way (delayrelay.go)
	trace        bool          // kcpplugin, the broker and the agent send every dial's spans to a receiver (tracing.go)

	// The hostile phase (hostile.go).
	hostileStreams int
	hostileMessage int64
	hostileFrame   int
	hostilePad     uint8
	hostileTunnels int
	hostileWait    time.Duration
}

func main() {
	if serveRole(os.Getenv(roleEnv)) {
		return
	}
	cfg, maxTime := parseFlags()
	b := newBench(cfg)
	defer b.close()
	b.stopOnSignalOrAfter(maxTime)
	ctx := context.Background()
	b.report.header(b)
	for _, p := range allPhases {
		if !slices.Contains(cfg.phases, p) {
			continue
		}
		b.logf("phase %s (load %s)", p, loadAvg())
		b.runPhase(ctx, p)
	}
	b.report.footer(b)
}

// serveRole serves role, if this process is a child started to serve one
// (see child.go), and says whether it did.
func serveRole(role string) bool {
	switch role {
	case "webhook":
		serveWebhook()
	case "relay":
		serveRelay()
	case "grpc-echo":
		serveGRPCEcho()
	case "echo":
		serveEcho()
	case "hops":
		serveHops()
	default:
		return false
	}
	return true
}

// parseFlags reads the command line into the run's config, and the bound
// of the whole run. It exits on a bad flag.
func parseFlags() (config, time.Duration) {
	var (
		cfg    config
		size   = flag.String("size", "1GiB", "bytes of each bulk transfer (download and upload), e.g. 1GiB, 64MiB")
		idle   = flag.String("idle", "1000,10000", "idle tunnel counts, comma-separated")
		flood  = flag.String("flood", "4GiB", "bytes the stalled connection of the isolation figure asks for")
		phases = flag.String("phases", strings.Join(allPhases, ","), "phases to run, comma-separated: "+strings.Join(allPhases, ","))
		quick  = flag.Bool("quick", false, "small sizes and short durations, for a smoke run (overrides -size, -duration, -dials, -paced-dials, -idle)")
	)
	flag.DurationVar(&cfg.duration, "duration", 5*time.Second, "length of each timed measurement (round trips, rates)")
	flag.IntVar(&cfg.conns, "conns", 16, "connections for the round-trips-per-second figure")
	flag.IntVar(&cfg.dials, "dials", 1000, "dials per path for the dial latency figure")
	flag.IntVar(&cfg.pacedDials, "paced-dials", 100, "paced phase: dials per path at a webhook client's pace")
	flag.DurationVar(&cfg.pacedPause, "paced-pause", 500*time.Millisecond, "paced phase: pause after each round of dials (one per path), so that every dial finds the processes idle")
	flag.IntVar(&cfg.webhookConns, "webhook-conns", 16, "concurrent kept-alive connections for the webhook rate figure")
	flag.StringVar(&cfg.profileDir, "profile-dir", "", "if set and the binaries serve pprof (--pprof-listen), save their CPU and heap profiles of the throughput, round-trip and dial runs here")
	flag.BoolVar(&cfg.relay, "relay", true, "also measure the relay reference path (caller -mTLS-> relay -mTLS-> relay -TCP-> target, plain TLS copy processes) in the throughput, latency, rps and dial phases and for the webhook on new connections, as relay_* rows")
	flag.StringVar(&cfg.peerBin, "peer-remotedialer", "", "if set, the remotedialer-peer binary (test/bench/peers/remotedialer/build.sh prints its path): also measure rancher's remotedialer as a peer in the throughput, latency, rps, dial, isolation, webhook and idle phases, as peer_remotedialer_* rows")
	flag.DurationVar(&cfg.timeout, "timeout", 3*time.Minute, "bound of one bulk transfer")
	flag.DurationVar(&cfg.hopDelay, "hop-delay", 0, "if > 0, every connection between two processes of every path crosses a relay (a child process) that holds each chunk of bytes this long each way, as a network would, e.g. 250us; leaves out the phases "+strings.Join(undelayedPhases, ", ")+" (0: off)")
	flag.BoolVar(&cfg.trace, "trace", false, "trace every dial: kcpplugin (a root span per dial), the broker and the agent send their spans by OTLP to a receiver in this process, as a traced kcp and tunnel would (off: tracing off, the default)")
	flag.IntVar(&cfg.hostileStreams, "hostile-streams", 1000, "hostile phase: streams one identity opens and never finishes, per case")
	hostileMessage := flag.String("hostile-message", "32KiB", "hostile phase: the size the first message announces (the broker's --max-message-size makes it maximal)")
	flag.IntVar(&cfg.hostileFrame, "hostile-frame", 16384, "hostile phase: bytes per HTTP/2 DATA frame (1 is the costliest for the broker)")
	hostilePad := flag.Uint("hostile-pad", 0, "hostile phase: bytes of padding (0-255) in each DATA frame, which no gRPC client sends")
	flag.IntVar(&cfg.hostileTunnels, "hostile-tunnels", 16, "hostile phase: tunnels kcp dials through the hostile agent, per tunnel case")
	flag.DurationVar(&cfg.hostileWait, "hostile-wait", time.Minute, "hostile phase: how long to wait for the broker to end the streams")
	maxTime := flag.Duration("max-time", 20*time.Minute, "bound of the whole run: stop everything and fail after it")
	flag.Parse()

	cfg.size = mustParseBytes("-size", *size)
	cfg.hostileMessage = mustParseBytes("-hostile-message", *hostileMessage)
	if *hostilePad > 255 {
		fatalf("-hostile-pad: at most 255, HTTP/2's most")
	}
	cfg.hostilePad = uint8(*hostilePad)
	cfg.flood = mustParseBytes("-flood", *flood)
	cfg.idle = parseIdleCounts(*idle)
	cfg.phases = parsePhases(*phases)
	if cfg.hopDelay < 0 {
		fatalf("-hop-delay: negative")
	}
	if cfg.hopDelay > 0 {
		cfg.phases = delayedPhases(cfg.phases, flagSet("phases"))
	}
	if *quick {
		cfg.size = 64 << 20
		cfg.duration = time.Second
		cfg.dials = 200
		cfg.pacedDials = 20
		cfg.idle = []int{100, 1000}
	}
	return cfg, *maxTime
}

// mustParseBytes is parseBytes of the value s of flag name, or exits.
func mustParseBytes(name, s string) int64 {
	n, err := parseBytes(s)
	if err != nil {
		fatalf("%s: %v", name, err)
	}
	return n
}

// parseIdleCounts reads -idle: positive counts, comma-separated; empty
// items are skipped. It exits on a bad count.
func parseIdleCounts(s string) []int {
	var counts []int
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		n, err := strconv.Atoi(f)
		if err != nil || n <= 0 {
			fatalf("-idle: bad count %q", f)
		}
		counts = append(counts, n)
	}
	return counts
}

// parsePhases reads -phases: names of allPhases, comma-separated; empty
// items are skipped. It exits on an unknown name.
func parsePhases(s string) []string {
	var phases []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p == "" {
			continue
		}
		if !slices.Contains(allPhases, p) {
			fatalf("-phases: unknown phase %q (have %s)", p, strings.Join(allPhases, ","))
		}
		phases = append(phases, p)
	}
	return phases
}

// flagSet says whether flag name was given on the command line.
func flagSet(name string) bool {
	set := false
	flag.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}

// delayedPhases is phases without those -hop-delay leaves out
// (undelayedPhases). Named on the command line (explicit), one of them is
// an error.
func delayedPhases(phases []string, explicit bool) []string {
	var kept []string
	for _, p := range phases {
		if !slices.Contains(undelayedPhases, p) {
			kept = append(kept, p)
		} else if explicit {
			fatalf("-hop-delay: the %s phase has no delayed hops (%s are left out); run it without -hop-delay", p, strings.Join(undelayedPhases, ", "))
		}
	}
	return kept
}

// stopOnSignalOrAfter makes sure that, whatever happens, the broker,
// agent, webhook, relay and peer processes are stopped before the program
// exits: on a signal, and once the run took longer than maxTime, it stops
// them and exits with status 1.
func (r *runner) stopOnSignalOrAfter(maxTime time.Duration) {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, os.Interrupt, syscall.SIGTERM)
	go func() {
		select {
		case s := <-stop:
			r.logf("%v: stopping", s)
		case <-time.After(maxTime):
			r.logf("the run took longer than -max-time %v: stopping", maxTime)
		}
		r.close()
		os.Exit(1)
	}()
}

// runPhase runs phase p, one of allPhases.
func (r *runner) runPhase(ctx context.Context, p string) {
	switch p {
	case "throughput":
		r.throughput(ctx)
	case "latency":
		r.latency(ctx)
	case "rps":
		r.roundTripRate(ctx)
	case "dial":
		r.dialLatency(ctx)
	case "paced":
		r.pacedDials(ctx)
	case "grpc":
		r.grpcFloor(ctx)
	case "isolation":
		r.isolation(ctx)
	case "tenants":
		r.tenants(ctx)
	case "webhook":
		r.webhookRate(ctx)
	case "idle":
		r.idleTunnels(ctx)
	case "hostile":
		r.hostile(ctx)
	case "scale":
		r.scale(ctx)
	}
}

// parseBytes reads a byte count with an optional KiB, MiB or GiB suffix.
func parseBytes(s string) (int64, error) {
	mult := int64(1)
	for _, u := range []struct {
		suffix string
		mult   int64
	}{{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}} {
		if rest, ok := strings.CutSuffix(s, u.suffix); ok {
			s, mult = rest, u.mult
			break
		}
	}
	n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
	if err != nil || n <= 0 {
		return 0, fmt.Errorf("bad byte count %q", s)
	}
	return n * mult, nil
}

func fatalf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "tunnelbench: "+format+"\n", args...)
	os.Exit(2)
}
