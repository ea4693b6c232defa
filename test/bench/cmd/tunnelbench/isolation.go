package main

import (
	"context"
	"time"

	"github.com/kcp-dev/tunnel-broker/test/bench"
)

// isolation measures connection B's 64-byte round trips alone, then again
// while connection A, to the same target host through the same broker,
// agent and gRPC connections, has asked for cfg.flood bytes and reads none
// of them. It reports B's p50 and p99 both ways, the slowdown (loaded p50 /
// unloaded p50) and how much of A's data the path buffered before it
// stalled. The peer path, when it runs, is measured the same way through its
// server and client.
func (r *runner) isolation(ctx context.Context) {
	res := map[string]isolationResult{}
	for _, p := range r.withPeer() {
		res[p.name] = r.isolationOn(ctx, p)
	}
	d, t := res["direct"], res["tunneled"]
	r.report.row("isolation_rtt64_alone_p50_us", d.unloaded, t.unloaded)
	r.report.row("isolation_rtt64_loaded_p50_us", d.loaded50, t.loaded50)
	r.report.row("isolation_rtt64_loaded_p99_us", d.loaded99, t.loaded99)
	r.report.row("isolation_slowdown_p50", d.loaded50/d.unloaded, t.loaded50/t.unloaded)
	r.report.row("isolation_stalled_buffered_MiB", d.pendingMiB, t.pendingMiB)
	if r.peer != nil {
		pr := res[peerName]
		r.report.floorRow(peerName, "isolation_rtt64_alone_p50_us", d.unloaded, pr.unloaded)
		r.report.floorRow(peerName, "isolation_rtt64_loaded_p50_us", d.loaded50, pr.loaded50)
		r.report.floorRow(peerName, "isolation_rtt64_loaded_p99_us", d.loaded99, pr.loaded99)
		r.report.floorRow(peerName, "isolation_slowdown_p50", d.loaded50/d.unloaded, pr.loaded50/pr.unloaded)
		r.report.floorRow(peerName, "isolation_stalled_buffered_MiB", d.pendingMiB, pr.pendingMiB)
	}
}

// isolationResult is one path's isolation figures: B's p50 alone, p50 and
// p99 while A stalls (µs), and the MiB of A's data the path buffered.
type isolationResult struct{ unloaded, loaded50, loaded99, pendingMiB float64 }

// isolationOn is isolation's measurement on path p.
func (r *runner) isolationOn(ctx context.Context, p path) isolationResult {
	flood := r.targets[svcIsoBulk]
	b := r.dialOrFatal(ctx, p, svcIsoEcho)
	alone, err := roundTrips(b, r.cfg.duration/2)
	if err != nil {
		r.m.Fatalf("%s: B alone: %v", p.name, err)
	}

	before := flood.Flooded.Load()
	a := r.dialOrFatal(ctx, p, svcIsoBulk)
	if err := bench.Flood(a, r.cfg.flood); err != nil {
		r.m.Fatalf("%s: A's request: %v", p.name, err)
	}
	waitStalled(flood)
	pending := flood.Flooded.Load() - before

	loaded, err := roundTrips(b, r.cfg.duration)
	if err != nil {
		r.m.Fatalf("%s: B while A stalls: %v", p.name, err)
	}
	if n := flood.Flooded.Load() - before; n != pending {
		r.logf("%s: A's target wrote %d more bytes while B ran: A's reader was not stalled", p.name, n-pending)
	}
	a.Close()
	b.Close()
	flood.CloseConns() // ends the target's blocked write
	r.logf("%s: A stalled with %.1f MiB written by its target; B: %d round trips alone, %d while A stalls",
		p.name, float64(pending)/(1<<20), len(alone), len(loaded))
	return isolationResult{
		unloaded:   bench.Micros(alone.Quantile(0.5)),
		loaded50:   bench.Micros(loaded.Quantile(0.5)),
		loaded99:   bench.Micros(loaded.Quantile(0.99)),
		pendingMiB: float64(pending) / (1 << 20),
	}
}

// waitStalled waits until flood's target can write no more, its count
// still for half a second: every buffer on the way is full. It gives up
// after 20 seconds.
func waitStalled(flood *bench.Target) {
	last, still := int64(-1), 0
	for deadline := time.Now().Add(20 * time.Second); still < 5 && time.Now().Before(deadline); {
		time.Sleep(100 * time.Millisecond)
		if n := flood.Flooded.Load(); n == last {
			still++
		} else {
			last, still = n, 0
		}
	}
}
