package main

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"time"

	"google.golang.org/grpc"

	"github.com/kcp-dev/tunnel-broker/kcpplugin"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/bench"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// Where the targets live for the tunnel: Services of one logical cluster.
const (
	cluster   = "root"
	namespace = "bench"
	agentPath = "/agent/sync-target-1"
)

// Services, each its own listener, so that one figure's connections (and
// their TIME_WAIT entries) never mix with another's.
const (
	svcEcho     = "echo"     // 64-byte round trips and their rate
	svcBulk     = "bulk"     // bulk transfers
	svcDial     = "dial"     // dial latency
	svcIsoEcho  = "iso-echo" // isolation: connection B
	svcIsoBulk  = "iso-bulk" // isolation: connection A, the stalled reader
	svcIdle     = "idle"     // idle tunnels
	svcTenant   = "tenant"   // tenants: the healthy tenant's dials
	svcWebhook  = "webhook"  // the TLS admission webhook
	portPlain   = 80
	portWebhook = 443
)

// runner holds one run's world: the trust domain, the targets, the broker
// and agent processes and kcp's dialer.
type runner struct {
	cfg     config
	m       *harness.Main
	env     *harness.Env
	report  *report
	started time.Time

	targets map[string]*bench.Target
	// addrs are the targets' addresses as every path reaches them: with
	// -hop-delay, each behind its delaying relay (r.hop).
	addrs   map[string]string // service -> target address
	webhook *webhookServer
	relay   *relay // nil unless the relay path runs
	peer    *peer  // nil unless the peer path runs
	hops    *hops  // the delaying relays' child; nil without -hop-delay
	hanging string // the hanging tenant's address: connects to it never complete
	// idleEcho is the echo target of the peer's idle figures, a child
	// process (peeridle.go), once started.
	idleEcho string

	// pprof is whether the binaries have --pprof-listen.
	pprof bool
	// otlp receives every process's spans, with -trace (tracing.go).
	otlp *harness.OTLPReceiver
	main *pair

	closeOnce sync.Once
}

// pair is a broker process, an agent process registered with it, and a kcp
// dialer connected to the broker.
type pair struct {
	broker, agent           *harness.Process
	brokerAddr              string // as the agent and kcp reach it (r.hop)
	brokerPprof, agentPprof string // "" without pprof
	egressSocket            string // the CONNECT front end's, as callers reach it (r.hopUnix); "" without one
	conn                    *grpc.ClientConn
	dialer                  *kcpplugin.Dialer
	// early dials over conn too, with kcpplugin's EarlyData: the first
	// write goes with the dial.
	early *kcpplugin.Dialer
}

func newBench(cfg config) *runner {
	r := &runner{cfg: cfg, m: &harness.Main{}, report: &report{}, started: time.Now(),
		targets: map[string]*bench.Target{}, addrs: map[string]string{}}
	r.env = harness.NewEnv(r.m)
	if cfg.hopDelay > 0 {
		r.hops = startHops(r.m, cfg.hopDelay)
	}
	for _, s := range []struct {
		name  string
		start func() (*bench.Target, error)
	}{
		{svcEcho, bench.StartEcho}, {svcBulk, bench.StartBulk}, {svcDial, bench.StartEcho},
		{svcIsoEcho, bench.StartEcho}, {svcIsoBulk, bench.StartBulk}, {svcIdle, bench.StartEcho},
		{svcTenant, bench.StartEcho},
	} {
		t, err := s.start()
		if err != nil {
			r.m.Fatal(err)
		}
		r.m.Cleanup(t.Close)
		r.targets[s.name] = t
		r.addrs[s.name] = r.hop(t.Addr)
	}
	r.webhook = startWebhookProcess(r.m)
	r.addrs[svcWebhook] = r.hop(r.webhook.Addr)
	// Not behind a relay, which would complete the connects that must
	// hang.
	r.hanging = harness.StartUnanswered(r.m)

	bin := harness.Binaries(r.m)
	r.pprof = hasFlag(filepath.Join(bin, "broker"), "pprof-listen") && hasFlag(filepath.Join(bin, "syncer-agent"), "pprof-listen")
	r.main = r.startPair()
	if relayWanted(cfg) {
		r.relay = r.startRelays()
	}
	if peerWanted(cfg) {
		r.peer = r.startPeer()
	}
	return r
}

// hasFlag says whether a binary's usage lists flag name.
func hasFlag(bin, name string) bool {
	out, _ := exec.Command(bin, "-h").CombinedOutput()
	return bytes.Contains(out, []byte("-"+name+" "))
}

// services is the agent's static table: every target as a Service of the
// bench namespace, and the hanging tenant's Service in a cluster of its own.
func (r *runner) services() lookup.StaticFile {
	f := lookup.StaticFile{Services: []lookup.StaticService{{
		Cluster: hangingCluster, Namespace: namespace, Name: svcHanging,
		Ports: map[string]string{fmt.Sprint(portPlain): r.hanging},
	}}}
	for name, addr := range r.addrs {
		port := portPlain
		if name == svcWebhook {
			port = portWebhook
		}
		f.Services = append(f.Services, lookup.StaticService{
			Cluster: cluster, Namespace: namespace, Name: name,
			Ports: map[string]string{fmt.Sprint(port): addr},
		})
	}
	return f
}

// startPair starts a broker and an agent process, with pprof endpoints when
// the binaries have them, and connects a kcp dialer to the broker. With
// -hop-delay, the agent and kcp's dialer reach the broker through one
// delaying relay, and CONNECT callers its socket through another.
func (r *runner) startPair() *pair {
	p := &pair{}
	var brokerExtra, agentExtra []string
	if r.pprof {
		p.brokerPprof, p.agentPprof = harness.FreeAddr(r.m), harness.FreeAddr(r.m)
		brokerExtra = []string{"--pprof-listen", p.brokerPprof}
		agentExtra = []string{"--pprof-listen", p.agentPprof}
	}
	if r.cfg.trace {
		if r.otlp == nil {
			r.otlp = r.startTracing()
		}
		flags := []string{"--otlp-endpoint", r.otlp.Endpoint}
		brokerExtra, agentExtra = append(brokerExtra, flags...), append(agentExtra, flags...)
	}
	var egress []string
	p.egressSocket, egress = egressFlags(harness.Binaries(r.m), r.env.Dir)
	p.broker, p.brokerAddr = r.env.StartBrokerProcess(append(brokerExtra, egress...)...)
	p.brokerAddr, p.egressSocket = r.hop(p.brokerAddr), r.hopUnix(p.egressSocket)
	p.agent = r.env.StartAgentProcess(p.brokerAddr, agentPath, r.services(), agentExtra...)
	p.conn = r.env.BrokerConn(p.brokerAddr, "/kcp")
	// dialer waits for each tunnel before it returns; early is kcp's
	// default.
	p.dialer = kcpplugin.NewDialer(p.conn)
	p.dialer.EarlyData = false
	p.early = kcpplugin.NewDialer(p.conn)
	p.early.EarlyData = true
	return p
}

// stop ends the pair's processes and connection.
func (p *pair) stop() {
	p.conn.Close()
	_ = p.agent.Stop()
	_ = p.broker.Stop()
}

// close stops everything once, from main or on a signal.
func (r *runner) close() { r.closeOnce.Do(r.m.Close) }

// logf reports progress on stderr; the table goes to stdout.
func (r *runner) logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "[%6.1fs] "+format+"\n", append([]any{time.Since(r.started).Seconds()}, args...)...)
}

// path is a way to reach a target: directly, or through the tunnel.
type path struct {
	name string
	dial func(ctx context.Context, svc string) (net.Conn, error)
}

func (r *runner) direct() path {
	return path{name: "direct", dial: func(ctx context.Context, svc string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", r.addrs[svc])
	}}
}

func (p *pair) tunneled() path { return tunnelPath("tunneled", p.dialer) }

// tunneledEarly is the tunnel through the pair with early data: the dial
// returns at once, and the first write goes with it.
func (p *pair) tunneledEarly() path { return tunnelPath(earlyName, p.early) }

// earlyName names the tunnel path with early data in rows and logs.
const earlyName = "early"

func tunnelPath(name string, d *kcpplugin.Dialer) path {
	return path{name: name, dial: func(ctx context.Context, svc string) (net.Conn, error) {
		port := int32(portPlain)
		if svc == svcWebhook {
			port = portWebhook
		}
		return d.DialService(ctx, cluster, namespace, svc, port)
	}}
}

// paths are the direct path, then the tunnel through the main pair.
func (r *runner) paths() []path { return []path{r.direct(), r.main.tunneled()} }

// withPeer is paths plus the peer path when it runs.
func (r *runner) withPeer() []path {
	ps := r.paths()
	if r.peer != nil {
		ps = append(ps, r.peer.path(r))
	}
	return ps
}

// allPaths is paths, then the relay and the peer paths, those that run.
func (r *runner) allPaths() []path {
	ps := r.paths()
	if r.relay != nil {
		ps = append(ps, r.relay.path(r))
	}
	if r.peer != nil {
		ps = append(ps, r.peer.path(r))
	}
	return ps
}

// newConnectionPaths is allPaths and the tunnel with early data, which
// only phases that open a connection per measurement tell apart, and the
// other caller legs (withOtherLegs).
func (r *runner) newConnectionPaths() []path {
	return r.withOtherLegs(append(r.allPaths(), r.main.tunneledEarly()))
}

// inTurn is the index of the path that goes j-th in round i of a phase that
// alternates n paths: each round starts one path further on, so that every
// path follows every other as often. A dial can leave work behind it that
// slows the next one (the relay's handshakes, the peer's teardown and
// logging); in a fixed order it always slowed the same path.
func inTurn(i, j, n int) int { return (i + j) % n }

// withOtherLegs is ps and the tunnel with the other caller leg, if it
// runs: the broker's CONNECT front end on a Unix socket. The phases that
// compare a message's and a new connection's cost with the peer's, whose
// caller speaks CONNECT over a Unix socket too, measure it beside the
// tunneled path.
func (r *runner) withOtherLegs(ps []path) []path {
	if c, ok := r.main.connect(); ok {
		ps = append(ps, c)
	}
	return ps
}

// dialOrFatal dials svc on p with a bound.
func (r *runner) dialOrFatal(ctx context.Context, p path, svc string) net.Conn {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	c, err := p.dial(ctx, svc)
	if err != nil {
		r.m.Fatalf("%s: dialing %s: %v", p.name, svc, err)
	}
	return c
}
