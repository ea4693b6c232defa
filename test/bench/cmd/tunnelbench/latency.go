package main

import (
	"context"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kcp-dev/tunnel-broker/test/bench"
)

// msgSize is the round trips' message: 64 bytes out, 64 back.
const msgSize = 64

// maxRoundTrips bounds one connection's samples, whatever the duration.
const maxRoundTrips = 1_000_000

// latency measures 64-byte round trips one after another on one connection
// per path, for cfg.duration, and reports p50, p99 and what the tunnel (and
// the relay, peer and CONNECT paths, when they run) adds.
func (r *runner) latency(ctx context.Context) {
	figs := map[string]rttFigures{}
	for _, p := range r.withConnect(r.allPaths()) {
		figs[p.name] = r.latencyOn(ctx, p)
	}
	d, t := figs["direct"], figs["tunneled"]
	r.report.row("rtt64_p50_us", d.p50, t.p50)
	r.report.row("rtt64_p99_us", d.p99, t.p99)
	r.report.row("rtt64_added_p50_us", none, t.p50-d.p50)
	r.report.row("rtt64_added_p99_us", none, t.p99-d.p99)
	r.report.row("rtt64_cpu_us_per_rt", d.cpuPerRT, t.cpuPerRT)
	r.report.row("rtt64_broker_cpu_us_per_rt", none, t.first)
	r.report.row("rtt64_agent_cpu_us_per_rt", none, t.second)
	if r.relay != nil {
		rl := figs["relay"]
		r.report.relayRow("rtt64_p50_us", d.p50, rl.p50)
		r.report.relayRow("rtt64_p99_us", d.p99, rl.p99)
		r.report.relayRow("rtt64_added_p50_us", none, rl.p50-d.p50)
		r.report.relayRow("rtt64_added_p99_us", none, rl.p99-d.p99)
		r.report.relayRow("rtt64_cpu_us_per_rt", d.cpuPerRT, rl.cpuPerRT)
		r.report.relayRow("rtt64_relay1_cpu_us_per_rt", none, rl.first)
		r.report.relayRow("rtt64_relay2_cpu_us_per_rt", none, rl.second)
	}
	if r.peer != nil {
		pr := figs[peerName]
		r.report.floorRow(peerName, "rtt64_p50_us", d.p50, pr.p50)
		r.report.floorRow(peerName, "rtt64_p99_us", d.p99, pr.p99)
		r.report.floorRow(peerName, "rtt64_added_p50_us", none, pr.p50-d.p50)
		r.report.floorRow(peerName, "rtt64_added_p99_us", none, pr.p99-d.p99)
		r.report.floorRow(peerName, "rtt64_cpu_us_per_rt", d.cpuPerRT, pr.cpuPerRT)
		r.report.floorRow(peerName, "rtt64_server_cpu_us_per_rt", none, pr.first)
		r.report.floorRow(peerName, "rtt64_client_cpu_us_per_rt", none, pr.second)
	}
	if c, ok := figs[connectName]; ok {
		r.report.floorRow(connectName, "rtt64_p50_us", d.p50, c.p50)
		r.report.floorRow(connectName, "rtt64_p99_us", d.p99, c.p99)
		r.report.floorRow(connectName, "rtt64_cpu_us_per_rt", d.cpuPerRT, c.cpuPerRT)
		r.report.floorRow(connectName, "rtt64_broker_cpu_us_per_rt", none, c.first)
		r.report.floorRow(connectName, "rtt64_agent_cpu_us_per_rt", none, c.second)
	}
}

// rttFigures are one path's round-trip latencies (µs) and CPU per round
// trip (µs): of every process, and of the path's two middle processes in
// order (broker and agent, relay1 and relay2, the peer's server and
// client; 0 for the direct path, which has none).
type rttFigures struct {
	p50, p99      float64
	cpuPerRT      float64
	first, second float64
}

// latencyOn is latency's measurement on path p.
func (r *runner) latencyOn(ctx context.Context, p path) rttFigures {
	stop := r.profilePath(ctx, p, "latency", r.cfg.duration)
	c := r.dialOrFatal(ctx, p, svcEcho)
	cpu0 := r.cpu()
	s, err := roundTrips(c, r.cfg.duration)
	used := r.cpu().sub(cpu0)
	c.Close()
	stop()
	if err != nil {
		r.m.Fatalf("%s round trips: %v", p.name, err)
	}
	perRT := func(d time.Duration) float64 { return bench.Micros(d) / float64(len(s)) }
	f := rttFigures{p50: bench.Micros(s.Quantile(0.5)), p99: bench.Micros(s.Quantile(0.99)), cpuPerRT: perRT(used.total())}
	switch p.name {
	case "tunneled", connectName:
		f.first, f.second = perRT(used.broker), perRT(used.agent)
	case "relay":
		f.first, f.second = perRT(used.relay1), perRT(used.relay2)
	case peerName:
		f.first, f.second = perRT(used.peerServer), perRT(used.peerClient)
	}
	r.logf("%s: %d round trips", p.name, len(s))
	return f
}

// roundTrips runs 64-byte round trips on c for d (after a short warm-up)
// and returns their latencies.
func roundTrips(c net.Conn, d time.Duration) (bench.Samples, error) {
	msg, buf := make([]byte, msgSize), make([]byte, msgSize)
	_ = c.SetDeadline(time.Now().Add(d + 30*time.Second))
	defer c.SetDeadline(time.Time{})
	for range 100 {
		if err := bench.RoundTrip(c, msg, buf); err != nil {
			return nil, err
		}
	}
	s := make(bench.Samples, 0, 1<<16)
	end := time.Now().Add(d)
	for len(s) < maxRoundTrips {
		start := time.Now()
		if err := bench.RoundTrip(c, msg, buf); err != nil {
			return nil, err
		}
		now := time.Now()
		s = append(s, now.Sub(start))
		if now.After(end) {
			break
		}
	}
	return s, nil
}

// roundTripRate runs 64-byte round trips on cfg.conns connections at once
// per path, each one after another, for cfg.duration, and reports the total
// round trips per second.
func (r *runner) roundTripRate(ctx context.Context) {
	rates := map[string]float64{}
	cpu := map[string]float64{}
	for _, p := range r.withConnect(r.allPaths()) {
		rates[p.name], cpu[p.name] = r.roundTripRateOn(ctx, p)
	}
	name := "rtt64_" + strconv.Itoa(r.cfg.conns) + "conns"
	r.report.row(name+"_per_s", rates["direct"], rates["tunneled"])
	r.report.row(name+"_cpu_us_per_rt", cpu["direct"], cpu["tunneled"])
	if r.relay != nil {
		r.report.relayRow(name+"_per_s", rates["direct"], rates["relay"])
		r.report.relayRow(name+"_cpu_us_per_rt", cpu["direct"], cpu["relay"])
	}
	if r.peer != nil {
		r.report.floorRow(peerName, name+"_per_s", rates["direct"], rates[peerName])
		r.report.floorRow(peerName, name+"_cpu_us_per_rt", cpu["direct"], cpu[peerName])
	}
	if rate, ok := rates[connectName]; ok {
		r.report.floorRow(connectName, name+"_per_s", rates["direct"], rate)
		r.report.floorRow(connectName, name+"_cpu_us_per_rt", cpu["direct"], cpu[connectName])
	}
}

// roundTripRateOn is roundTripRate's measurement on path p: round trips
// per second, and CPU (µs) per round trip of every process.
func (r *runner) roundTripRateOn(ctx context.Context, p path) (rate, cpuPerRT float64) {
	stop := r.profilePath(ctx, p, "rps", r.cfg.duration)
	conns := make([]net.Conn, r.cfg.conns)
	for i := range conns {
		conns[i] = r.dialOrFatal(ctx, p, svcEcho)
	}
	cpu0 := r.cpu()
	start := time.Now()
	total, err := roundTripsUntil(conns, start.Add(r.cfg.duration))
	took := time.Since(start)
	used := r.cpu().sub(cpu0)
	for _, c := range conns {
		c.Close()
	}
	stop()
	if err != nil {
		r.m.Fatalf("%s round trips: %v", p.name, err)
	}
	r.logf("%s: %d round trips on %d connections in %v", p.name, total, r.cfg.conns, took.Round(time.Millisecond))
	return float64(total) / took.Seconds(), bench.Micros(used.total()) / float64(max(1, total))
}

// roundTripsUntil runs 64-byte round trips on every one of conns at once,
// each one after another, until end (at most maxRoundTrips per
// connection), and returns how many completed in all. A connection that
// fails stops; the error returned is one of theirs.
func roundTripsUntil(conns []net.Conn, end time.Time) (int64, error) {
	var (
		total  atomic.Int64
		failed atomic.Value
		wg     sync.WaitGroup
	)
	for _, c := range conns {
		wg.Go(func() {
			msg, buf := make([]byte, msgSize), make([]byte, msgSize)
			_ = c.SetDeadline(end.Add(30 * time.Second))
			for n := 0; n < maxRoundTrips && time.Now().Before(end); n++ {
				if err := bench.RoundTrip(c, msg, buf); err != nil {
					failed.Store(err)
					return
				}
				total.Add(1)
			}
		})
	}
	wg.Wait()
	err, _ := failed.Load().(error)
	return total.Load(), err
}
