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
	paths := r.withOtherLegs(r.allPaths())
	figs := map[string]rttFigures{}
	for _, p := range paths {
		figs[p.name] = r.latencyOn(ctx, p)
	}
	d := figs["direct"]
	for _, p := range paths[1:] {
		f := figs[p.name]
		row := func(name string, direct, v float64) { r.report.pathRow(p.name, name, direct, v) }
		row("rtt64_p50_us", d.p50, f.p50)
		row("rtt64_p99_us", d.p99, f.p99)
		row("rtt64_added_p50_us", none, f.p50-d.p50)
		row("rtt64_added_p99_us", none, f.p99-d.p99)
		row("rtt64_cpu_us_per_rt", d.cpuPerRT, f.cpuPerRT)
		row("rtt64_"+f.middle[0]+"_cpu_us_per_rt", none, f.first)
		row("rtt64_"+f.middle[1]+"_cpu_us_per_rt", none, f.second)
	}
}

// rttFigures are one path's round-trip latencies (µs) and CPU per round
// trip (µs): of every process, and of the path's two middle processes in
// order, named middle (cpuTimes.middleOf; 0 for the direct path, which has
// none).
type rttFigures struct {
	p50, p99      float64
	cpuPerRT      float64
	first, second float64
	middle        [2]string
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
	m := used.middleOf(p.name)
	f.first, f.second, f.middle = perRT(m.used[0]), perRT(m.used[1]), m.names
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
	paths := r.withOtherLegs(r.allPaths())
	rates := map[string]float64{}
	cpu := map[string]float64{}
	for _, p := range paths {
		rates[p.name], cpu[p.name] = r.roundTripRateOn(ctx, p)
	}
	name := "rtt64_" + strconv.Itoa(r.cfg.conns) + "conns"
	for _, p := range paths[1:] {
		r.report.pathRow(p.name, name+"_per_s", rates["direct"], rates[p.name])
		r.report.pathRow(p.name, name+"_cpu_us_per_rt", cpu["direct"], cpu[p.name])
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
