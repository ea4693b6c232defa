package main

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"sigs.k8s.io/yaml"

	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/kcpplugin"
	"github.com/kcp-dev/tunnel-broker/test/bench"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// scaleConfig is the scale phase's own flags (registered here, so that
// main.go only lists the phase).
type scaleConfig struct {
	agents, clusters, big   int
	inFlight                int
	dials                   int
	reregisters, bigRereg   int
	idle, restart, profiles time.Duration
	vanish                  int
	vanishWatch             time.Duration
}

var scaleCfg scaleConfig

func init() {
	flag.IntVar(&scaleCfg.agents, "scale-agents", 5000, "scale phase: simulated agents registered with one broker")
	flag.IntVar(&scaleCfg.clusters, "scale-clusters", 20, "scale phase: logical clusters each simulated agent serves")
	flag.IntVar(&scaleCfg.big, "scale-big", 10000, "scale phase: logical clusters of the one large agent (the broker's --max-clusters-per-registration is 10000)")
	flag.IntVar(&scaleCfg.inFlight, "scale-in-flight", 64, "scale phase: registrations under way at once (each agent connects, handshakes, registers)")
	flag.IntVar(&scaleCfg.dials, "scale-dials", 1000, "scale phase: dials to the broker with one agent and as many to the broker with all, alternated")
	flag.IntVar(&scaleCfg.reregisters, "scale-reregisters", 5000, "scale phase: re-registrations of a changed cluster list whose broker CPU is averaged")
	flag.IntVar(&scaleCfg.bigRereg, "scale-big-reregisters", 10, "scale phase: the same for the large agent")
	flag.DurationVar(&scaleCfg.idle, "scale-idle", 30*time.Second, "scale phase: how long the idle traffic and CPU are measured")
	flag.DurationVar(&scaleCfg.restart, "scale-restart", time.Minute, "scale phase: the rolling restart (each agent disconnects and reconnects once) is spread over this long")
	flag.IntVar(&scaleCfg.vanish, "scale-vanish", 10, "scale phase: agents that hang (their connection stays open, silent) and reconnect on a new one")
	flag.DurationVar(&scaleCfg.vanishWatch, "scale-vanish-watch", 25*time.Second, "scale phase: how long the hung agents' clusters are dialed after they reconnected (the broker's keepalive drops a silent connection after about 15s)")
	flag.DurationVar(&scaleCfg.profiles, "scale-profile", 15*time.Second, "scale phase, with -profile-dir: length of the broker's CPU profile of the registrations")
}

// The one agent both brokers know, whose cluster the dials go to, and the
// large agent.
const bigAgent = 99999999

// scaleWorld is the scale phase's brokers, load process and callers:
// broker "one" has one simulated agent, broker "many" has them all (the
// same agent among them), so that every figure of one is measured on both,
// side by side.
type scaleWorld struct {
	cfg        scaleConfig
	one, many  *scaleBroker
	load       *loadChild
	timedAgent int
}

type scaleBroker struct {
	label   string
	proc    *harness.Process
	args    []string // its flags but --listen
	addr    string
	pprof   string // "" without pprof
	metrics string
	dialer  *kcpplugin.Dialer
}

func (b *scaleBroker) pid() int { return b.proc.Cmd.Process.Pid }

// scale measures one broker replica with many agents against one with a
// single agent: memory and goroutines per agent, the registrations, idle
// traffic and CPU, dial latency, re-registrations, and a rolling restart
// of every agent while dials run, and every agent's return to a replica
// that restarted.
func (r *runner) scale(ctx context.Context) {
	cfg := scaleCfg
	if f := flag.Lookup("quick"); f != nil && f.Value.String() == "true" {
		cfg.agents, cfg.idle, cfg.restart, cfg.dials, cfg.reregisters, cfg.bigRereg = 500, 5*time.Second, 10*time.Second, 200, 200, 5
		cfg.vanishWatch = 5 * time.Second
	}
	if cfg.agents < 1 || cfg.clusters < 1 || cfg.big < 1 {
		r.m.Fatalf("-scale-agents, -scale-clusters and -scale-big must be positive")
	}
	r.raiseFileLimit(2*cfg.agents + 4096)
	w := r.startScale(cfg)
	r.report.note("scale_* rows: broker \"one\" has one simulated agent, broker \"many\" has %d (%d logical clusters each, %d in all), all in one load process with a gRPC connection and Connect stream each; direct= is broker one's figure, tunneled= broker many's (per agent where the name says so), ratio many/one",
		cfg.agents, cfg.clusters, cfg.agents*cfg.clusters)
	r.report.note("scale: registrations at most %d under way at once, no other pacing; scale_load_* rows are the load process's CPU, not the broker's", cfg.inFlight)

	for _, step := range []struct {
		name string
		run  func()
	}{
		{"registrations", func() { r.scaleRegister(ctx, w) }},
		{"metrics", func() { r.scaleMetrics(ctx, w) }},
		{"idle", func() { r.scaleIdle(ctx, w) }},
		{"dials", func() { r.scaleDials(ctx, w) }},
		{"re-registrations", func() { r.scaleReregister(ctx, w, w.timedAgent, cfg.clusters, cfg.reregisters) }},
		{"large agent", func() { r.scaleBig(ctx, w) }},
		{"rolling restart", func() { r.scaleRestart(ctx, w) }},
		{"hung agents", func() { r.scaleVanish(ctx, w) }},
		{"broker restart", func() { r.scaleReturn(ctx, w) }},
	} {
		r.logf("scale: %s (load %s)", step.name, loadAvg())
		step.run()
	}
	r.logf("scale: done")
}

// raiseFileLimit makes sure this process and its children (the brokers,
// the load process) may hold need file descriptors: Go raises each
// process's soft limit to its hard limit at start, so the hard limit is
// what counts; root may raise it.
func (r *runner) raiseFileLimit(need int) {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		r.m.Fatal(err)
	}
	if lim.Max < uint64(need) {
		want := syscall.Rlimit{Cur: uint64(need), Max: uint64(need)}
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &want); err != nil {
			r.m.Fatalf("scale: %d file descriptors are needed and RLIMIT_NOFILE is %d (raising it: %v); run as root or raise it (ulimit -Hn)", need, lim.Max, err)
		}
		lim = want
	} else if lim.Cur < uint64(need) {
		lim.Cur = lim.Max
		_ = syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim)
	}
	r.report.note("scale: RLIMIT_NOFILE %d/%d (soft/hard), inherited by the brokers and the load process (Go raises a process's soft limit to its hard limit at start)", lim.Cur, lim.Max)
}

// startScale writes the policy, starts both brokers and the load process,
// and connects a kcp dialer to each broker.
func (r *runner) startScale(cfg scaleConfig) *scaleWorld {
	td := "spiffe://" + harness.TrustDomain
	f := policy.File{
		// One syncer per sync target, each bound to its clusters, as a
		// kcp deployment would write it; one cluster more each for the
		// re-registrations.
		Agents:      []policy.AgentRule{{ID: td + "/agent/{syncTarget}"}},
		SyncTargets: map[string][]string{scaleAgentName(bigAgent): scaleClusters(bigAgent, 0, cfg.big+1)},
		Callers:     []policy.CallerRule{{ID: td + "/kcp"}},
		Operators:   []policy.OperatorRule{{ID: td + "/operator"}},
	}
	for i := range cfg.agents {
		f.SyncTargets[scaleAgentName(i)] = scaleClusters(i, 0, cfg.clusters+1)
	}
	raw, err := yaml.Marshal(f)
	if err != nil {
		r.m.Fatal(err)
	}
	policyFile := filepath.Join(r.env.Dir, "scale-policy.yaml")
	must(r.m, os.WriteFile(policyFile, raw, 0o644))

	w := &scaleWorld{cfg: cfg, timedAgent: cfg.agents / 2}
	start := func(label string) *scaleBroker {
		b := &scaleBroker{label: label}
		extra := []string{"--policy", policyFile}
		// The re-registration rows measure the broker's work per list, not
		// its pace of 4 lists a second (which a loop of 5,000 would meet).
		if hasFlag(filepath.Join(harness.Binaries(r.m), "broker"), "max-reregistrations-per-second") {
			extra = append(extra, "--max-reregistrations-per-second=-1")
		}
		if r.pprof {
			b.pprof = harness.FreeAddr(r.m)
			extra = append(extra, "--pprof-listen", b.pprof)
		}
		t := time.Now()
		b.args = extra
		b.proc, b.addr = r.env.StartBrokerProcess(extra...)
		r.logf("scale: broker %s started in %v with a policy of %d KiB", label, time.Since(t).Round(time.Millisecond), len(raw)>>10)
		b.metrics = b.proc.MetricsAddr(r.m)
		// Each dial waits for its tunnel: the phase times dials and counts
		// those the broker could not route.
		b.dialer = kcpplugin.NewDialer(r.env.BrokerConn(b.addr, "/kcp"))
		b.dialer.EarlyData = false
		return b
	}
	w.one, w.many = start("one"), start("many")
	w.load = r.startLoad()
	return w
}

func must(t harness.T, err error) {
	if err != nil {
		t.Fatal(err)
	}
}

// loadChild is the load process (scaleload.go) and its command pipe.
type loadChild struct {
	pid int
	mu  sync.Mutex
	in  io.Writer
	out *bufio.Scanner
}

// startLoad starts the load process with the trust domain's CA.
func (r *runner) startLoad() *loadChild {
	certFile, keyFile := filepath.Join(r.env.Dir, "scale-ca.crt"), filepath.Join(r.env.Dir, "scale-ca.key")
	key, ok := r.env.CA.Key.(*ecdsa.PrivateKey)
	if !ok {
		r.m.Fatalf("scale: the dev CA's key is a %T, not ECDSA", r.env.CA.Key)
	}
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		r.m.Fatal(err)
	}
	must(r.m, os.WriteFile(certFile, r.env.CA.BundlePEM(), 0o600))
	must(r.m, os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der}), 0o600))

	self, err := os.Executable()
	if err != nil {
		r.m.Fatal(err)
	}
	cmd := exec.Command(self)
	cmd.Env = append(os.Environ(), roleEnv+"="+roleScaleLoad, envScaleCACert+"="+certFile, envScaleCAKey+"="+keyFile)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		r.m.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		r.m.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		r.m.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	r.m.Cleanup(func() {
		stdin.Close()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	})
	out := bufio.NewScanner(stdout)
	out.Buffer(make([]byte, 1<<20), 64<<20)
	if !out.Scan() || out.Text() != "listening load" {
		r.m.Fatalf("scale: the load process did not start: %v", out.Err())
	}
	return &loadChild{pid: cmd.Process.Pid, in: stdin, out: out}
}

// do sends req to the load process and returns its reply.
func (l *loadChild) do(req loadRequest) (loadReply, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	raw, err := json.Marshal(req)
	if err != nil {
		return loadReply{}, err
	}
	if _, err := l.in.Write(append(raw, '\n')); err != nil {
		return loadReply{}, err
	}
	if !l.out.Scan() {
		return loadReply{}, fmt.Errorf("the load process ended: %v", l.out.Err())
	}
	var rep loadReply
	if err := json.Unmarshal(l.out.Bytes(), &rep); err != nil {
		return loadReply{}, err
	}
	if rep.Err != "" {
		return rep, errors.New(rep.Err)
	}
	return rep, nil
}

func (r *runner) loadDo(w *scaleWorld, req loadRequest) loadReply {
	rep, err := w.load.do(req)
	if err != nil {
		r.m.Fatalf("scale: load process: %s: %v", req.Op, err)
	}
	return rep
}

// cpuOf is the CPU time process pid has used so far.
func (r *runner) cpuOf(pid int) time.Duration {
	d, err := bench.ProcCPU(pid)
	if err != nil {
		r.m.Fatal(err)
	}
	return d
}

// scaleRegister registers the timed agent with broker one, then every
// agent with broker many, and reports the registrations and what the
// brokers hold for their agents.
func (r *runner) scaleRegister(ctx context.Context, w *scaleWorld) {
	cfg := w.cfg
	time.Sleep(settle)
	one0, many0 := r.read(ctx, w.one.pid(), w.one.pprof), r.read(ctx, w.many.pid(), w.many.pprof)

	oneRep := r.loadDo(w, loadRequest{Op: "register", Broker: "one", Addr: w.one.addr, Indices: []int{w.timedAgent}, PerAgent: cfg.clusters, InFlight: 1})

	indices := make([]int, cfg.agents)
	for i := range indices {
		indices[i] = i
	}
	stopProfile := r.scaleProfile(ctx, w.many, "register", cfg.profiles)
	cpu0, load0 := r.cpuOf(w.many.pid()), r.cpuOf(w.load.pid)
	rep := r.loadDo(w, loadRequest{Op: "register", Broker: "many", Addr: w.many.addr, Indices: indices, PerAgent: cfg.clusters, InFlight: cfg.inFlight})
	cpu, load := r.cpuOf(w.many.pid())-cpu0, r.cpuOf(w.load.pid)-load0
	stopProfile()
	if rep.Failed > 0 || oneRep.Failed > 0 {
		r.m.Fatalf("scale: %d of %d agents failed to register (see the load process's log above)", rep.Failed+oneRep.Failed, cfg.agents+1)
	}
	r.logf("scale: %d agents registered in %v", cfg.agents, rep.Took.Round(time.Millisecond))
	time.Sleep(settle)
	one1, many1 := r.read(ctx, w.one.pid(), w.one.pprof), r.read(ctx, w.many.pid(), w.many.pprof)
	r.saveScaleProfiles(ctx, w.many, "registered")

	n := float64(cfg.agents)
	lat := bench.Samples(rep.Latencies)
	r.report.row("scale_register_all_s", oneRep.Took.Seconds(), rep.Took.Seconds())
	r.report.row("scale_register_per_s", none, n/rep.Took.Seconds())
	r.report.row("scale_register_p50_ms", bench.Millis(oneRep.Latencies[0]), bench.Millis(lat.Quantile(0.5)))
	r.report.row("scale_register_p99_ms", bench.Millis(oneRep.Latencies[0]), bench.Millis(lat.Quantile(0.99)))
	r.report.row("scale_register_broker_cpu_ms_per_agent", none, bench.Millis(cpu)/n)
	r.report.row("scale_load_register_cpu_ms_per_agent", none, bench.Millis(load)/n)
	per := func(before, after int64, count float64) float64 { return float64(after-before) / count }
	// One agent's memory is below the noise of a process's RSS and heap
	// (and the first agent pays for lazy setup): broker one has no such
	// figure; its totals follow.
	r.report.row("scale_broker_rss_KiB_per_agent", none, per(many0.status.RSSKiB, many1.status.RSSKiB, n))
	if many0.memory != nil && many1.memory != nil {
		r.report.row("scale_broker_go_heap_KiB_per_agent", none, per(many0.memory.HeapInuse>>10, many1.memory.HeapInuse>>10, n))
		r.report.row("scale_broker_go_stacks_KiB_per_agent", none, per(many0.memory.StackInuse>>10, many1.memory.StackInuse>>10, n))
	}
	if one0.goroutines >= 0 && one1.goroutines >= 0 && many0.goroutines >= 0 && many1.goroutines >= 0 {
		r.report.row("scale_broker_goroutines_per_agent", per(int64(one0.goroutines), int64(one1.goroutines), 1), per(int64(many0.goroutines), int64(many1.goroutines), n))
	}
	r.report.row("scale_broker_rss_MiB", float64(one1.status.RSSKiB)/1024, float64(many1.status.RSSKiB)/1024)
	r.report.row("scale_broker_threads", float64(one1.status.Threads), float64(many1.status.Threads))
	if st, err := bench.ReadProcStatus(w.load.pid); err == nil {
		r.report.row("scale_load_rss_KiB_per_agent", none, float64(st.RSSKiB)/n)
	}
}

// scaleMetrics times one scrape of each broker's /metrics, which has
// series per agent and per logical cluster.
func (r *runner) scaleMetrics(ctx context.Context, w *scaleWorld) {
	scrape := func(b *scaleBroker) (time.Duration, int64, int) {
		var best time.Duration
		var size int64
		var series int
		for range 3 {
			start := time.Now()
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+b.metrics+"/metrics", nil)
			if err != nil {
				r.m.Fatal(err)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				r.m.Fatalf("scale: scraping broker %s: %v", b.label, err)
			}
			raw, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil {
				r.m.Fatalf("scale: scraping broker %s: %v", b.label, err)
			}
			took := time.Since(start)
			if best == 0 || took < best {
				best = took
			}
			size = int64(len(raw))
			series = 0
			for _, line := range strings.Split(string(raw), "\n") {
				if line != "" && line[0] != '#' {
					series++
				}
			}
		}
		return best, size, series
	}
	oneTook, oneSize, oneSeries := scrape(w.one)
	manyTook, manySize, manySeries := scrape(w.many)
	r.report.row("scale_metrics_scrape_ms", bench.Millis(oneTook), bench.Millis(manyTook))
	r.report.row("scale_metrics_scrape_KiB", float64(oneSize)/1024, float64(manySize)/1024)
	r.report.row("scale_metrics_series", float64(oneSeries), float64(manySeries))
}

// scaleIdle measures, over cfg.idle with nothing else going on, the bytes
// the agents' connections carry (probes, their answers, HTTP/2 pings: TLS
// records as they cross the socket, both ways) and the brokers' CPU.
func (r *runner) scaleIdle(ctx context.Context, w *scaleWorld) {
	cfg := w.cfg
	time.Sleep(settle)
	stopProfile := r.scaleProfile(ctx, w.many, "idle", cfg.idle)
	oneW0 := r.loadDo(w, loadRequest{Op: "wire", Broker: "one"})
	manyW0 := r.loadDo(w, loadRequest{Op: "wire", Broker: "many"})
	oneCPU0, manyCPU0, load0 := r.cpuOf(w.one.pid()), r.cpuOf(w.many.pid()), r.cpuOf(w.load.pid)
	start := time.Now()
	time.Sleep(cfg.idle)
	oneW1 := r.loadDo(w, loadRequest{Op: "wire", Broker: "one"})
	manyW1 := r.loadDo(w, loadRequest{Op: "wire", Broker: "many"})
	oneCPU, manyCPU, load := r.cpuOf(w.one.pid())-oneCPU0, r.cpuOf(w.many.pid())-manyCPU0, r.cpuOf(w.load.pid)-load0
	took := time.Since(start).Seconds()
	stopProfile()
	n := float64(cfg.agents)
	wire := func(a, b loadReply) float64 { return float64(b.Read-a.Read+b.Written-a.Written) / took }
	r.report.row("scale_idle_wire_B_per_s_per_agent", wire(oneW0, oneW1), wire(manyW0, manyW1)/n)
	r.report.row("scale_idle_broker_cpu_ms_per_s", bench.Millis(oneCPU)/took, bench.Millis(manyCPU)/took)
	r.report.row("scale_idle_broker_cpu_us_per_s_per_agent", bench.Micros(oneCPU)/took, bench.Micros(manyCPU)/took/n)
	r.report.row("scale_load_idle_cpu_us_per_s_per_agent", none, bench.Micros(load)/took/n)
}

// scaleDials times cfg.dials dials to the timed agent's cluster through
// each broker, alternating, as the dial phase does.
func (r *runner) scaleDials(ctx context.Context, w *scaleWorld) {
	cfg := w.cfg
	cluster := scaleCluster(w.timedAgent, 0)
	dial := func(b *scaleBroker) time.Duration {
		ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		start := time.Now()
		c, err := b.dialer.DialService(ctx, cluster, namespace, svcDial, portPlain)
		if err != nil {
			r.m.Fatalf("scale: dialing %s through broker %s: %v", cluster, b.label, err)
		}
		took := time.Since(start)
		c.Close()
		return took
	}
	dial(w.one)
	dial(w.many)
	var one, many bench.Samples
	stopProfile := r.scaleProfile(ctx, w.many, "dial", time.Duration(cfg.dials)*2*time.Millisecond)
	deadline := time.Now().Add(time.Duration(cfg.dials) * 50 * time.Millisecond)
	for i := 0; i < cfg.dials && time.Now().Before(deadline); i++ {
		// Each broker goes first every other time, so that neither
		// always follows the other's dial.
		if i%2 == 0 {
			one = append(one, dial(w.one))
			many = append(many, dial(w.many))
		} else {
			many = append(many, dial(w.many))
			one = append(one, dial(w.one))
		}
	}
	stopProfile()
	r.report.row("scale_dial_p50_us", bench.Micros(one.Quantile(0.5)), bench.Micros(many.Quantile(0.5)))
	r.report.row("scale_dial_p99_us", bench.Micros(one.Quantile(0.99)), bench.Micros(many.Quantile(0.99)))
}

// routed dials cluster through b until a dial succeeds (a cluster no agent
// serves is refused at once with Unavailable), and returns when that
// dial started.
func (r *runner) routed(ctx context.Context, b *scaleBroker, cluster string) time.Time {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for {
		start := time.Now()
		c, err := b.dialer.DialService(ctx, cluster, namespace, svcDial, portPlain)
		if err == nil {
			c.Close()
			return start
		}
		if status.Code(err) != codes.Unavailable || ctx.Err() != nil {
			r.m.Fatalf("scale: dialing %s through broker %s: %v", cluster, b.label, err)
		}
	}
}

// scaleReregister measures agent i re-registering a changed list of n
// clusters (one cluster out, one in) with each broker: the time from the
// request to the first dial to the new cluster that succeeds (median of
// a few), and the broker's CPU per re-registration, averaged over count
// sent back to back.
func (r *runner) scaleReregister(ctx context.Context, w *scaleWorld, i, n, count int) {
	name := fmt.Sprintf("scale_reregister_%d_", n)
	measure := func(b *scaleBroker) (time.Duration, time.Duration) {
		var took bench.Samples
		for rep := range 5 {
			// Alternate the lists from 0 and from 1: the cluster that
			// only the new one has is the one to reach.
			from := (rep + 1) % 2
			start := time.Now()
			r.loadDo(w, loadRequest{Op: "reregister", Broker: b.label, Index: i, PerAgent: n, Froms: []int{from}})
			newCluster := scaleCluster(i, 0)
			if from == 1 {
				newCluster = scaleCluster(i, n)
			}
			took = append(took, r.routed(ctx, b, newCluster).Sub(start))
		}
		// The list ends from 0, as it started.
		froms := make([]int, max(1, count))
		for k := range froms {
			froms[k] = (len(froms) - 1 - k) % 2
		}
		cpu0 := r.cpuOf(b.pid())
		r.loadDo(w, loadRequest{Op: "reregister", Broker: b.label, Index: i, PerAgent: n, Froms: froms})
		r.routed(ctx, b, scaleCluster(i, 0))
		cpu := r.cpuOf(b.pid()) - cpu0
		return took.Quantile(0.5), cpu / time.Duration(len(froms))
	}
	stopProfile := func() {}
	if n > w.cfg.clusters {
		stopProfile = r.scaleProfile(ctx, w.many, "reregister-big", 10*time.Second)
	}
	oneTook, oneCPU := measure(w.one)
	manyTook, manyCPU := measure(w.many)
	stopProfile()
	r.report.row(name+"routed_ms", bench.Millis(oneTook), bench.Millis(manyTook))
	r.report.row(name+"broker_cpu_ms", bench.Millis(oneCPU), bench.Millis(manyCPU))
}

// scaleBig registers one large agent with each broker and measures its
// re-registrations.
func (r *runner) scaleBig(ctx context.Context, w *scaleWorld) {
	cfg := w.cfg
	reg := func(b *scaleBroker) time.Duration {
		rep := r.loadDo(w, loadRequest{Op: "register", Broker: b.label, Addr: b.addr, Indices: []int{bigAgent}, PerAgent: cfg.big, InFlight: 1})
		if rep.Failed > 0 {
			r.m.Fatalf("scale: the agent of %d clusters failed to register with broker %s", cfg.big, b.label)
		}
		return rep.Latencies[0]
	}
	one, many := reg(w.one), reg(w.many)
	r.report.row(fmt.Sprintf("scale_register_%d_ms", cfg.big), bench.Millis(one), bench.Millis(many))
	r.scaleReregister(ctx, w, bigAgent, cfg.big, cfg.bigRereg)
}

// scaleRestart restarts every agent of broker many once, spread over
// cfg.restart, while two callers dial clusters through it: half the dials
// to agents that restart about now, half to any agent. A dial that fails
// while its agent is away (from its disconnect to its new registered) is
// expected; one that fails while its agent is registered is a fault.
func (r *runner) scaleRestart(ctx context.Context, w *scaleWorld) {
	cfg := w.cfg
	stopProfile := r.scaleProfile(ctx, w.many, "restart", cfg.restart)
	indices := make([]int, cfg.agents)
	for i := range indices {
		indices[i] = i
	}
	startRep := r.loadDo(w, loadRequest{Op: "restart", Broker: "many", Indices: indices, PerAgent: cfg.clusters, Over: cfg.restart})
	d := &restartDials{}
	began := time.Unix(0, startRep.Start)
	stopDials := d.run(ctx, w, func() int {
		if rand.IntN(2) == 0 {
			// An agent due within the last half second.
			due := time.Since(began) - time.Duration(rand.Int64N(int64(500*time.Millisecond)))
			return max(0, min(cfg.agents-1, int(int64(due)*int64(cfg.agents)/int64(cfg.restart))))
		}
		return rand.IntN(cfg.agents)
	})
	rep := r.loadDo(w, loadRequest{Op: "restart_wait"})
	// Dials go on a moment after the last agent is back.
	time.Sleep(time.Second)
	stopDials()
	stopProfile()

	away, neverBack := timesAway(rep.Away)
	awayFailed, connectedFailed := r.sortRestartFailures(d.failures, rep.Away)
	r.report.note("scale restart: %d agents each disconnected and reconnected once over %v (even ones unregistering cleanly first, odd ones dropping their connection); %d dials, %d failed while their agent was away, %d while it was registered; %d agents did not come back",
		len(rep.Away), cfg.restart, d.dials, awayFailed, connectedFailed, neverBack)
	r.report.row("scale_restart_dials", none, float64(d.dials))
	r.report.row("scale_restart_dials_failed_agent_registered", none, float64(connectedFailed))
	r.report.row("scale_restart_dials_failed_agent_away", none, float64(awayFailed))
	r.report.row("scale_restart_agents_not_back", none, float64(neverBack))
	r.report.row("scale_restart_away_p50_ms", none, bench.Millis(away.Quantile(0.5)))
	r.report.row("scale_restart_away_p99_ms", none, bench.Millis(away.Quantile(0.99)))
}

// restartDials are the dials of the rolling restart: how many, and the
// ones that failed.
type restartDials struct {
	mu       sync.Mutex
	dials    int
	failures []restartFailure
}

// restartFailure is a dial to a cluster of agent that failed with err.
type restartFailure struct {
	agent      int
	start, end time.Time
	err        error
}

// run has two callers dial clusters of broker many's agents that pick
// chooses, until the returned stop is called. The rolling restart sends
// half the dials to an agent due to restart about now, so that the dials
// meet agents as they leave and come back; the other half to any agent.
func (d *restartDials) run(ctx context.Context, w *scaleWorld, pick func() int) (stop func()) {
	cfg := w.cfg
	stopping := make(chan struct{})
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() {
			for {
				select {
				case <-stopping:
					return
				default:
				}
				agent := pick()
				start, end, err := w.many.dialAndClose(ctx, scaleCluster(agent, rand.IntN(cfg.clusters)))
				d.record(restartFailure{agent, start, end, err})
			}
		})
	}
	return func() {
		close(stopping)
		wg.Wait()
	}
}

// record counts dial f, and keeps it if it failed.
func (d *restartDials) record(f restartFailure) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.dials++
	if f.err != nil {
		d.failures = append(d.failures, f)
	}
}

// dialAndClose dials cluster through b as kcp, bounded by 10 seconds, and
// closes the connection if it got one: the scale phase's dials only count
// whether the broker routed them. It returns when the dial started and
// when it returned.
func (b *scaleBroker) dialAndClose(ctx context.Context, cluster string) (start, end time.Time, err error) {
	dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	start = time.Now()
	c, err := b.dialer.DialService(dctx, cluster, namespace, svcDial, portPlain)
	end = time.Now()
	if err == nil {
		c.Close()
	}
	return start, end, err
}

// timesAway is how long each agent that came back was away, and how many
// never came back, from a load reply's Away.
func timesAway(byAgent map[int][2]int64) (away bench.Samples, neverBack int) {
	for _, a := range byAgent {
		if a[1] == 0 {
			neverBack++
			continue
		}
		away = append(away, time.Duration(a[1]-a[0]))
	}
	return away, neverBack
}

// sortRestartFailures counts the failed dials whose agent was away and the
// ones whose agent was registered, the fault; it logs the first ten faults.
// An agent is away from its disconnect until its new registered arrived;
// one that never came back is away from its disconnect on.
func (r *runner) sortRestartFailures(failures []restartFailure, byAgent map[int][2]int64) (awayFailed, connectedFailed int) {
	for _, f := range failures {
		a, ok := byAgent[f.agent]
		isAway := ok && f.end.UnixNano() >= a[0] && (a[1] == 0 || f.start.UnixNano() <= a[1])
		if isAway {
			awayFailed++
			continue
		}
		connectedFailed++
		if connectedFailed <= 10 {
			r.logf("scale: restart: a dial to agent %d failed while it was registered (away %v..%v, dial %v..%v): %v",
				f.agent, time.Unix(0, a[0]).Format(time.StampMicro), time.Unix(0, a[1]).Format(time.StampMicro),
				f.start.Format(time.StampMicro), f.end.Format(time.StampMicro), f.err)
		}
	}
	return awayFailed, connectedFailed
}

// scaleProfile starts a CPU profile of broker b for window; stop waits for
// it. Without -profile-dir or pprof it does nothing.
func (r *runner) scaleProfile(ctx context.Context, b *scaleBroker, name string, window time.Duration) (stop func()) {
	if r.cfg.profileDir == "" || b.pprof == "" {
		return func() {}
	}
	if err := os.MkdirAll(r.cfg.profileDir, 0o755); err != nil {
		r.logf("profiles: %v", err)
		return func() {}
	}
	ctx, cancel := context.WithTimeout(ctx, window+30*time.Second)
	done := make(chan struct{})
	go func() {
		defer close(done)
		path := filepath.Join(r.cfg.profileDir, fmt.Sprintf("broker-scale-%s.cpu.pprof", name))
		seconds := max(1, int(window.Round(time.Second)/time.Second))
		if err := bench.FetchProfile(ctx, b.pprof, fmt.Sprintf("profile?seconds=%d", seconds), path); err != nil {
			r.logf("profile %s: %v", path, err)
		}
	}()
	return func() { <-done; cancel() }
}

// saveScaleProfiles saves broker b's heap profile and goroutines.
func (r *runner) saveScaleProfiles(ctx context.Context, b *scaleBroker, name string) {
	if r.cfg.profileDir == "" || b.pprof == "" {
		return
	}
	if err := os.MkdirAll(r.cfg.profileDir, 0o755); err != nil {
		r.logf("profiles: %v", err)
		return
	}
	for profile, file := range map[string]string{"heap": "heap.pprof", "goroutine?debug=1": "goroutines.txt"} {
		path := filepath.Join(r.cfg.profileDir, fmt.Sprintf("broker-scale-%s.%s", name, file))
		if err := bench.FetchProfile(ctx, b.pprof, profile, path); err != nil {
			r.logf("profile %s: %v", path, err)
		}
	}
}

// scaleVanish makes cfg.vanish agents of broker many hang and reconnect on
// a new connection at once, then dials their clusters for cfg.vanishWatch:
// until the broker drops the silent registration, it is still routed to.
func (r *runner) scaleVanish(ctx context.Context, w *scaleWorld) {
	cfg := w.cfg
	if cfg.vanish <= 0 {
		return
	}
	var indices []int
	for k := range min(cfg.vanish, cfg.agents) {
		if i := k*cfg.agents/cfg.vanish + 1; i < cfg.agents && i != w.timedAgent {
			indices = append(indices, i)
		}
	}
	rep := r.loadDo(w, loadRequest{Op: "vanish", Broker: "many", Indices: indices, PerAgent: cfg.clusters})
	d := vanishDials{codes: map[codes.Code]int{}}
	deadline := time.Now().Add(cfg.vanishWatch)
	var wg sync.WaitGroup
	for _, i := range indices {
		for range 2 {
			wg.Go(func() { d.watch(ctx, w, i, rep.Away[i], deadline) })
		}
	}
	wg.Wait()
	summary := []string{}
	for c, n := range d.codes {
		summary = append(summary, fmt.Sprintf("%d %s", n, c))
	}
	if len(summary) == 0 {
		summary = append(summary, "none")
	}
	slices.Sort(summary)
	r.report.note("scale vanish: %d agents hung (socket open, silent) and reconnected at once on a new connection; %d dials to their clusters over %v, all after the new registration: %d failed (%s); the last failed dial started %v after its agent hung",
		len(indices), d.dials, cfg.vanishWatch, d.failed, strings.Join(summary, ", "), d.lastFailure.Round(time.Millisecond))
	r.report.row("scale_vanish_dials", none, float64(d.dials))
	r.report.row("scale_vanish_dials_failed_agent_registered", none, float64(d.failed))
	r.report.row("scale_vanish_stale_routed_s", none, d.lastFailure.Seconds())
}

// vanishDials are the dials to the hung agents' clusters after they
// reconnected: how many, how many failed and with which codes, and how
// long after its agent hung the last failed one started.
type vanishDials struct {
	mu            sync.Mutex
	dials, failed int
	lastFailure   time.Duration
	codes         map[codes.Code]int
}

// watch dials clusters of agent i, which hung at away[0] and registered
// anew at away[1] (unix ns), one after another until deadline.
func (d *vanishDials) watch(ctx context.Context, w *scaleWorld, i int, away [2]int64, deadline time.Time) {
	hung, back := time.Unix(0, away[0]), time.Unix(0, away[1])
	for time.Now().Before(deadline) {
		// A dial started within the watch runs to its end: one routed
		// to a hung agent fails only at the broker's dial timeout (5 s).
		start, _, err := w.many.dialAndClose(ctx, scaleCluster(i, rand.IntN(w.cfg.clusters)))
		d.mu.Lock()
		d.dials++
		// Every dial starts after the agent's new registered.
		if err != nil && start.After(back) {
			d.failed++
			d.codes[status.Code(err)]++
			d.lastFailure = max(d.lastFailure, start.Sub(hung))
		}
		d.mu.Unlock()
	}
}

// scaleOutage is how long broker many is down before its agents return.
const scaleOutage = 5 * time.Second

// scaleReturn is a replica's restart with every agent coming back to it at
// once: broker many is killed, its agents all try to register again at
// once, each as the real agent does (gRPC's reconnect backoff, 250ms to
// the agent's 2s ceiling, with jitter; no pacing of their own), and the
// broker starts again on the same address scaleOutage later. It measures
// how long after the broker served every agent was registered again, the
// broker's CPU meanwhile, and the dials that failed to an agent already
// back. The broker paces the herd by its bound on handshakes in progress.
func (r *runner) scaleReturn(ctx context.Context, w *scaleWorld) {
	cfg := w.cfg
	indices := make([]int, cfg.agents)
	for i := range indices {
		indices[i] = i
	}
	w.many.proc.Kill()
	returned := make(chan loadReply, 1)
	go func() {
		returned <- r.loadDo(w, loadRequest{Op: "register", Broker: "many", Addr: w.many.addr, Indices: indices, PerAgent: cfg.clusters, InFlight: cfg.agents})
	}()
	time.Sleep(scaleOutage)
	w.many.proc, _ = r.env.StartBrokerProcess(append(slices.Clone(w.many.args), "--listen", w.many.addr)...)
	serving := time.Now()
	w.many.metrics = w.many.proc.MetricsAddr(r.m)
	cpu0 := r.cpuOf(w.many.pid())
	d := &restartDials{}
	stopDials := d.run(ctx, w, func() int { return rand.IntN(cfg.agents) })
	rep := <-returned
	cpu := r.cpuOf(w.many.pid()) - cpu0
	time.Sleep(time.Second)
	stopDials()

	var back bench.Samples
	for _, a := range rep.Away {
		if a[1] != 0 {
			back = append(back, max(0, time.Unix(0, a[1]).Sub(serving)))
		}
	}
	awayFailed, connectedFailed := r.sortRestartFailures(d.failures, rep.Away)
	all := slices.Max(append(back, 0))
	r.report.note("scale return: broker many killed, its %d agents trying to register again at once, the broker back on its address %v later; %d came back, %d did not within 30s; %d dials, %d failed while their agent was away, %d while it was registered",
		cfg.agents, scaleOutage, len(back), rep.Failed, d.dials, awayFailed, connectedFailed)
	r.report.row("scale_return_all_s", none, all.Seconds())
	r.report.row("scale_return_p50_ms", none, bench.Millis(back.Quantile(0.5)))
	r.report.row("scale_return_p99_ms", none, bench.Millis(back.Quantile(0.99)))
	r.report.row("scale_return_broker_cpu_ms_per_agent", none, bench.Millis(cpu)/float64(cfg.agents))
	r.report.row("scale_return_agents_not_back", none, float64(rep.Failed))
	// Handshakes the herd cost the broker for nothing: refused or dropped
	// for room (over_limit), or given up by their agent (closed, timeout).
	for _, reason := range []string{"over_limit", "closed", "timeout"} {
		n, _ := harness.Scrape(r.m, w.many.proc, `kcp_tunnel_broker_handshakes_refused_total{reason="`+reason+`"}`)
		r.report.row("scale_return_handshakes_"+reason, none, n)
	}
	r.report.row("scale_return_dials_failed_agent_registered", none, float64(connectedFailed))
}
