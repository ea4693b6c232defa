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
// the relay and peer paths, when they run) adds.
func (r *runner) latency(ctx context.Context) {
	q := map[string][2]float64{}
	cpu := map[string]float64{}
	var broker, agent, relay1, relay2, server, client float64
	for _, p := range r.allPaths() {
		var stop func()
		if p.name == "tunneled" {
			stop = r.profile(ctx, "latency", r.cfg.duration)
		}
		c := r.dialOrFatal(ctx, p, svcEcho)
		cpu0 := r.cpu()
		s, err := roundTrips(c, r.cfg.duration)
		used := r.cpu().sub(cpu0)
		c.Close()
		if stop != nil {
			stop()
		}
		if err != nil {
			r.m.Fatalf("%s round trips: %v", p.name, err)
		}
		q[p.name] = [2]float64{bench.Micros(s.Quantile(0.5)), bench.Micros(s.Quantile(0.99))}
		perRT := func(d time.Duration) float64 { return bench.Micros(d) / float64(len(s)) }
		cpu[p.name] = perRT(used.total())
		switch p.name {
		case "tunneled":
			broker, agent = perRT(used.broker), perRT(used.agent)
		case "relay":
			relay1, relay2 = perRT(used.relay1), perRT(used.relay2)
		case peerName:
			server, client = perRT(used.peerServer), perRT(used.peerClient)
		}
		r.logf("%s: %d round trips", p.name, len(s))
	}
	d, t := q["direct"], q["tunneled"]
	r.report.row("rtt64_p50_us", d[0], t[0])
	r.report.row("rtt64_p99_us", d[1], t[1])
	r.report.row("rtt64_added_p50_us", none, t[0]-d[0])
	r.report.row("rtt64_added_p99_us", none, t[1]-d[1])
	r.report.row("rtt64_cpu_us_per_rt", cpu["direct"], cpu["tunneled"])
	r.report.row("rtt64_broker_cpu_us_per_rt", none, broker)
	r.report.row("rtt64_agent_cpu_us_per_rt", none, agent)
	if r.relay != nil {
		rl := q["relay"]
		r.report.relayRow("rtt64_p50_us", d[0], rl[0])
		r.report.relayRow("rtt64_p99_us", d[1], rl[1])
		r.report.relayRow("rtt64_added_p50_us", none, rl[0]-d[0])
		r.report.relayRow("rtt64_added_p99_us", none, rl[1]-d[1])
		r.report.relayRow("rtt64_cpu_us_per_rt", cpu["direct"], cpu["relay"])
		r.report.relayRow("rtt64_relay1_cpu_us_per_rt", none, relay1)
		r.report.relayRow("rtt64_relay2_cpu_us_per_rt", none, relay2)
	}
	if r.peer != nil {
		pr := q[peerName]
		r.report.floorRow(peerName, "rtt64_p50_us", d[0], pr[0])
		r.report.floorRow(peerName, "rtt64_p99_us", d[1], pr[1])
		r.report.floorRow(peerName, "rtt64_added_p50_us", none, pr[0]-d[0])
		r.report.floorRow(peerName, "rtt64_added_p99_us", none, pr[1]-d[1])
		r.report.floorRow(peerName, "rtt64_cpu_us_per_rt", cpu["direct"], cpu[peerName])
		r.report.floorRow(peerName, "rtt64_server_cpu_us_per_rt", none, server)
		r.report.floorRow(peerName, "rtt64_client_cpu_us_per_rt", none, client)
	}
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
	for _, p := range r.allPaths() {
		var stop func()
		if p.name == "tunneled" {
			stop = r.profile(ctx, "rps", r.cfg.duration)
		}
		conns := make([]net.Conn, r.cfg.conns)
		for i := range conns {
			conns[i] = r.dialOrFatal(ctx, p, svcEcho)
		}
		cpu0 := r.cpu()
		var (
			total  atomic.Int64
			failed atomic.Value
			wg     sync.WaitGroup
			start  = time.Now()
			end    = start.Add(r.cfg.duration)
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
		took := time.Since(start)
		used := r.cpu().sub(cpu0)
		for _, c := range conns {
			c.Close()
		}
		if stop != nil {
			stop()
		}
		if err, _ := failed.Load().(error); err != nil {
			r.m.Fatalf("%s round trips: %v", p.name, err)
		}
		rates[p.name] = float64(total.Load()) / took.Seconds()
		cpu[p.name] = bench.Micros(used.total()) / float64(max(1, total.Load()))
		r.logf("%s: %d round trips on %d connections in %v", p.name, total.Load(), r.cfg.conns, took.Round(time.Millisecond))
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
}
