package e2e

import (
	"context"
	"fmt"
	"net"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kcp-dev/tunnel-broker/kcpplugin"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// The Restart tests run kcp's dials at a steady rate through kcpplugin, with
// its defaults, while broker replicas are replaced, drained, lost and cut
// off, and count every dial that fails. kcp reaches the replicas as in a
// cluster: through a ClusterIP Service, whose stand-in (harness.ServiceVIP)
// sends each new connection to a ready replica. The agents run with their
// defaults and name every replica address a test will use, as a headless
// Service's DNS name would once the replica is up.
//
// They log how long the way back took; they assert no time (machines are
// shared and noisy), only that no dial failed where none may, and that
// dials work again where they may not.

// dialRate is kcp's dials per second in these tests.
const dialRate = 50

// restartGrace is the brokers' --grace in these tests.
const restartGrace = 3 * time.Second

// fleet is the broker replicas of a test, on loopback addresses that share
// a port, as pods behind a headless Service do, and the VIP kcp dials.
type fleet struct {
	t    *testing.T
	env  *harness.Env
	port string
	vip  *harness.ServiceVIP

	mu   sync.Mutex
	live map[string]*harness.Process // by gRPC address
}

func newFleet(t *testing.T, env *harness.Env, hosts ...string) *fleet {
	f := &fleet{t: t, env: env, port: freePortOnAll(t, hosts...), vip: harness.StartServiceVIP(t), live: map[string]*harness.Process{}}
	f.vip.FollowReadiness(t, &f.mu, f.live)
	return f
}

func (f *fleet) addr(host string) string { return net.JoinHostPort(host, f.port) }

// addrs is every address of hosts, for the agents' --broker.
func (f *fleet) addrs(hosts ...string) string {
	var out []string
	for _, h := range hosts {
		out = append(out, f.addr(h))
	}
	return strings.Join(out, ",")
}

// start runs a replica on host.
func (f *fleet) start(host string) *harness.Process {
	f.t.Helper()
	p, _ := f.env.StartBrokerProcess("--listen", f.addr(host), "--id", "broker-"+host, "--grace", restartGrace.String())
	f.mu.Lock()
	f.live[f.addr(host)] = p
	f.mu.Unlock()
	return p
}

// waitReady waits until the replica's /readyz says ready, as the rollout
// does, and returns when it saw it; then until the Service lists it.
func (f *fleet) waitReady(p *harness.Process) time.Time {
	f.t.Helper()
	harness.Eventually(f.t, 60*time.Second, "the replica to be ready", p.ReadyNow)
	ready := time.Now()
	f.mu.Lock()
	var addr string
	for a, q := range f.live {
		if q == p {
			addr = a
		}
	}
	f.mu.Unlock()
	harness.Eventually(f.t, 10*time.Second, "the Service to list the replica", func() bool {
		return slices.Contains(f.vip.Endpoints(), addr)
	})
	return ready
}

// drain sends the replica SIGTERM, as the rollout does, and waits for it to
// exit.
func (f *fleet) drain(p *harness.Process) {
	f.t.Helper()
	_ = p.Cmd.Process.Signal(syscall.SIGTERM)
	if err := p.Exited(f.t, restartGrace+20*time.Second); err != nil {
		f.t.Errorf("drained replica exited with %v", err)
	}
}

// dialer is kcp's: kcpplugin's client and dialer with their defaults,
// through the VIP.
func (f *fleet) dialer() *kcpplugin.Dialer {
	return kcpplugin.NewDialer(f.env.BrokerConn(f.vip.Addr, "/kcp"))
}

// runAgent runs an agent binary as identity path, serving an echo in
// cluster, registered with every replica of brokers (comma-separated).
func runAgent(t *testing.T, env *harness.Env, brokers, path, cluster string) *harness.Process {
	t.Helper()
	echo := harness.StartEcho(t)
	return env.RunAgentProcess(brokers, path[strings.LastIndex(path, "/")+1:], env.SVID(path), lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: cluster, Namespace: "default", Name: "echo", Ports: map[string]string{"80": echo}},
	}})
}

// dialResult is one of kcp's dials: an echo round trip through a new tunnel.
type dialResult struct {
	cluster    string
	start, end time.Time
	err        error
}

// dialLoad runs kcp's dials at a steady rate, each in its own goroutine so
// that a slow one does not slow the rate, until stopped.
type dialLoad struct {
	mu      sync.Mutex
	results []dialResult
	stop    chan struct{}
	wg      sync.WaitGroup
}

func startDialLoad(d *kcpplugin.Dialer, clusters ...string) *dialLoad {
	l := &dialLoad{stop: make(chan struct{})}
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		tick := time.NewTicker(time.Second / dialRate)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-l.stop:
				return
			case <-tick.C:
			}
			cluster := clusters[i%len(clusters)]
			l.wg.Add(1)
			go func() {
				defer l.wg.Done()
				start := time.Now()
				err := dialEchoCtxCluster(context.Background(), d, cluster)
				l.mu.Lock()
				l.results = append(l.results, dialResult{cluster: cluster, start: start, end: time.Now(), err: err})
				l.mu.Unlock()
			}()
		}
	}()
	return l
}

// finish stops the load and waits for the dials in flight.
func (l *dialLoad) finish() {
	close(l.stop)
	l.wg.Wait()
}

// failed are the dials of cluster (any: "") started in [from, to) that
// failed; total counts those started then.
func (l *dialLoad) failed(cluster string, from, to time.Time) (failed []dialResult, total int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, r := range l.results {
		if cluster != "" && r.cluster != cluster || r.start.Before(from) || !r.start.Before(to) {
			continue
		}
		total++
		if r.err != nil {
			failed = append(failed, r)
		}
	}
	return failed, total
}

// noneFailed logs how many dials of cluster (any: "") started from from
// on, and fails the test, listing them, if any failed; during says when.
func (l *dialLoad) noneFailed(t *testing.T, cluster string, from time.Time, during string) {
	t.Helper()
	failed, total := l.failed(cluster, from, time.Now())
	t.Logf("%d dials %s, %d failed", total, during, len(failed))
	if len(failed) > 0 {
		since := from
		if since.IsZero() {
			since = l.results[0].start
		}
		t.Errorf("%d of %d dials failed %s:%s", len(failed), total, during, describe(failed, since))
	}
}

// firstSuccess is when the first dial of cluster started at or after from
// that worked ended.
func (l *dialLoad) firstSuccess(cluster string, from time.Time) (time.Time, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var first time.Time
	for _, r := range l.results {
		if r.cluster == cluster && r.err == nil && !r.start.Before(from) && (first.IsZero() || r.end.Before(first)) {
			first = r.end
		}
	}
	return first, !first.IsZero()
}

// waitForSuccess waits until a dial of cluster started at or after from
// has worked, and returns when it ended.
func (l *dialLoad) waitForSuccess(t *testing.T, cluster string, from time.Time) time.Time {
	t.Helper()
	var at time.Time
	harness.Eventually(t, 60*time.Second, "a dial to "+cluster+" to work", func() bool {
		var ok bool
		at, ok = l.firstSuccess(cluster, from)
		return ok
	})
	return at
}

// describe lists up to 5 failures, with their errors, for a test's message.
func describe(failed []dialResult, since time.Time) string {
	sort.Slice(failed, func(i, j int) bool { return failed[i].start.Before(failed[j].start) })
	var b strings.Builder
	for i, r := range failed {
		if i == 5 {
			fmt.Fprintf(&b, "\n  ... and %d more", len(failed)-5)
			break
		}
		fmt.Fprintf(&b, "\n  at +%.2fs, %s: %v", r.start.Sub(since).Seconds(), r.cluster, r.err)
	}
	return b.String()
}

// TestRestartRollingUpdateFailsNoDial replaces both replicas of a
// two-replica broker by new ones on new addresses, one at a time, as a
// Deployment's rolling update with maxSurge 1 does: a new replica starts,
// the rollout waits for its readiness and minReadySeconds, then drains an
// old one. Tunnels are open throughout. Not one of kcp's dials may fail.
func TestRestartRollingUpdateFailsNoDial(t *testing.T) {
	env := harness.NewEnv(t)
	hosts := []string{"127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"}
	f := newFleet(t, env, hosts...)
	old := []*harness.Process{f.start(hosts[0]), f.start(hosts[1])}
	runAgent(t, env, f.addrs(hosts...), "/agent/sync-target-1", "root")
	runAgent(t, env, f.addrs(hosts...), "/agent/sync-target-2", "team-a")
	for _, p := range old {
		f.waitReady(p)
	}
	kcp := f.dialer()
	// A tunnel open through the rollout, as a webhook's kept-alive
	// connection: it may end with its replica's grace, never fail a dial.
	held, err := dialEchoConn(kcp)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	roundTrip(t, held, "the held tunnel")

	start := time.Now()
	load := startDialLoad(kcp, "root", "team-a")
	// minReadySeconds: the agents name the new address from the start, so
	// they join within their reconnect ceiling (2s); in a cluster it covers
	// their --resolve-interval too (deploy/README.md).
	const minReady = 3 * time.Second
	for i, p := range old {
		next := f.start(hosts[2+i])
		readyAt := f.waitReady(next)
		t.Logf("new replica %s ready %.1fs after it started", hosts[2+i], readyAt.Sub(start).Seconds())
		time.Sleep(minReady)
		f.drain(p)
		start = time.Now()
	}
	time.Sleep(time.Second)
	load.finish()
	load.noneFailed(t, "", time.Time{}, "during the rolling update")
}

// TestRestartDrainMovesNewDialsToTheOtherReplica drains the replica kcp's
// connection is on, while tunnels are open through it and dials go on: the
// drain's GOAWAY moves kcp's connection to the other replica at once, the
// open tunnels run on through the grace period, and no dial fails.
func TestRestartDrainMovesNewDialsToTheOtherReplica(t *testing.T) {
	env := harness.NewEnv(t)
	hosts := []string{"127.0.0.2", "127.0.0.3"}
	f := newFleet(t, env, hosts...)
	replicas := map[string]*harness.Process{f.addr(hosts[0]): f.start(hosts[0]), f.addr(hosts[1]): f.start(hosts[1])}
	runAgent(t, env, f.addrs(hosts...), "/agent/sync-target-1", "root")
	for _, p := range replicas {
		f.waitReady(p)
	}
	kcp := f.dialer()
	var open []net.Conn
	for i := range 3 {
		c, err := dialEchoConn(kcp)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		// Established now: with early data, the dial goes with the first
		// write.
		roundTrip(t, c, fmt.Sprintf("tunnel %d before the drain", i))
		open = append(open, c)
	}
	var draining string
	for addr := range f.vip.Open() {
		draining = addr
	}
	load := startDialLoad(kcp, "root")
	time.Sleep(time.Second)

	drainStart := time.Now()
	_ = replicas[draining].Cmd.Process.Signal(syscall.SIGTERM)
	// The tunnels open on the draining replica go on.
	time.Sleep(restartGrace / 2)
	for i, c := range open {
		roundTrip(t, c, fmt.Sprintf("tunnel %d during the drain", i))
	}
	harness.Eventually(t, 10*time.Second, "kcp's connection to move to the other replica", func() bool {
		moved := f.vip.Open()
		return moved[draining] == 0 && len(moved) == 1
	})
	if err := replicas[draining].Exited(t, restartGrace+20*time.Second); err != nil {
		t.Errorf("drained replica exited with %v", err)
	}
	time.Sleep(time.Second)
	load.finish()
	load.noneFailed(t, "", drainStart, "from the drain's start on, while a replica drained")
}

// TestRestartAfterAnOutage stops every replica for a while, then starts one
// on a new address, and measures how long after its readiness kcp's dials
// work again: agents and kcpplugin retry with a ceiling of a few seconds,
// so the way back does not grow with the outage.
func TestRestartAfterAnOutage(t *testing.T) {
	for i, outage := range []time.Duration{5 * time.Second, 20 * time.Second, 60 * time.Second} {
		t.Run(outage.String(), func(t *testing.T) {
			t.Parallel()
			env := harness.NewEnv(t)
			hosts := []string{fmt.Sprintf("127.0.1.%d", 2*i+1), fmt.Sprintf("127.0.1.%d", 2*i+2)}
			f := newFleet(t, env, hosts...)
			first := f.start(hosts[0])
			runAgent(t, env, f.addrs(hosts...), "/agent/sync-target-1", "root")
			f.waitReady(first)
			load := startDialLoad(f.dialer(), "root")
			defer load.finish()
			load.waitForSuccess(t, "root", time.Time{})

			first.Kill()
			time.Sleep(outage)
			started := time.Now()
			next := f.start(hosts[1])
			ready := f.waitReady(next)
			back := load.waitForSuccess(t, "root", started)
			t.Logf("after a %v outage: the new replica ready %.1fs after its start; the first dial worked %.1fs after its start, %.1fs after it was ready",
				outage, ready.Sub(started).Seconds(), back.Sub(started).Seconds(), back.Sub(ready).Seconds())
			// The dials that waited through the outage go out together once
			// kcp's connection is back; past the agent's 256 pending dials
			// for the cluster, that burst is refused (ResourceExhausted).
			// Once it has passed, every dial works.
			time.Sleep(4 * time.Second)
			burst, _ := load.failed("root", ready, back.Add(2*time.Second))
			t.Logf("%d dials failed in the burst of those that waited:%s", len(burst), describe(burst, ready))
			if failed, total := load.failed("root", back.Add(2*time.Second), time.Now().Add(-time.Second)); len(failed) > 0 {
				t.Errorf("%d of %d dials failed after the way back:%s", len(failed), total, describe(failed, ready))
			}
		})
	}
}

// TestRestartAfterAPartitionOfOneAgent cuts one physical cluster's agent
// off every replica for 20s. That cluster's dials fail meanwhile; another
// cluster's never do; and once the path heals, the cut-off cluster's
// dials work again within the agent's reconnect ceiling.
func TestRestartAfterAPartitionOfOneAgent(t *testing.T) {
	env := harness.NewEnv(t)
	hosts := []string{"127.0.0.2", "127.0.0.3"}
	f := newFleet(t, env, hosts...)
	var paths []*harness.Partition
	var started []*harness.Process
	var viaPaths []string
	for _, h := range hosts {
		started = append(started, f.start(h))
		paths = append(paths, harness.StartPartition(t, f.addr(h)))
		viaPaths = append(viaPaths, paths[len(paths)-1].Addr)
	}
	runAgent(t, env, strings.Join(viaPaths, ","), "/agent/sync-target-1", "root")
	runAgent(t, env, f.addrs(hosts...), "/agent/sync-target-2", "team-a")
	for _, p := range started {
		f.waitReady(p)
	}
	load := startDialLoad(f.dialer(), "root", "team-a")
	load.waitForSuccess(t, "root", time.Time{})
	load.waitForSuccess(t, "team-a", time.Time{})

	cut := time.Now()
	for _, p := range paths {
		p.Cut()
	}
	time.Sleep(20 * time.Second)
	healed := time.Now()
	for _, p := range paths {
		p.Heal()
	}
	back := load.waitForSuccess(t, "root", healed)
	cutFailed, cutTotal := load.failed("root", cut, healed)
	t.Logf("cut off for 20s: %d of %d dials to the cluster failed meanwhile; its first dial worked %.1fs after the path healed",
		len(cutFailed), cutTotal, back.Sub(healed).Seconds())
	time.Sleep(2 * time.Second)
	load.finish()
	load.noneFailed(t, "team-a", time.Time{}, "to a cluster that was not cut off")
}
