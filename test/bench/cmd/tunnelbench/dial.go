package main

import (
	"context"
	"time"

	"github.com/kcp-dev/tunnel-broker/test/bench"
)

// dialLatency times cfg.dials dials per path, one after another, alternating
// direct and tunneled so that load on the machine hits both alike. A
// tunneled dial is DialService: the Dial RPC until the broker's established,
// which comes after the agent connected to the target, so the stream is
// usable; there is no TLS inside. A direct dial is a TCP connect. Each
// connection is closed before the next dial.
//
// A relay dial (when the relay path runs) is more than a tunneled one: the
// tunnel reuses its long-lived gRPC connections, while the relay path makes
// two TCP connections and mTLS handshakes per dial (caller to relay 1, relay
// 1 to relay 2), then relay 2's connect to the target and its answer. So its
// rows say so (relay_dial_2handshakes_*), and relay_handshake_* is the
// caller's TCP connect and handshake to relay 1 alone, from the same dials.
func (r *runner) dialLatency(ctx context.Context) {
	paths := r.withRelay()
	samples := make([]bench.Samples, len(paths))
	var handshakes bench.Samples
	// Warm up: the first dial of each path pays for lazy setup.
	for _, p := range paths {
		r.dialOrFatal(ctx, p, svcDial).Close()
	}
	// About a millisecond a dial and path: the profile covers most dials.
	stop := r.profile(ctx, "dial", time.Duration(r.cfg.dials*len(paths))*time.Millisecond)
	deadline := time.Now().Add(time.Duration(r.cfg.dials) * 50 * time.Millisecond)
	for i := 0; i < r.cfg.dials && time.Now().Before(deadline); i++ {
		for j, p := range paths {
			start := time.Now()
			c := r.dialOrFatal(ctx, p, svcDial)
			samples[j] = append(samples[j], time.Since(start))
			if rc, ok := c.(*relayConn); ok {
				handshakes = append(handshakes, rc.handshake)
			}
			c.Close()
		}
	}
	stop()
	for j, p := range paths {
		r.logf("%s: %d dials", p.name, len(samples[j]))
	}
	d, t := samples[0], samples[1]
	r.report.row("dial_p50_us", bench.Micros(d.Quantile(0.5)), bench.Micros(t.Quantile(0.5)))
	r.report.row("dial_p99_us", bench.Micros(d.Quantile(0.99)), bench.Micros(t.Quantile(0.99)))
	if r.relay != nil {
		rl := samples[2]
		r.report.relayRow("dial_2handshakes_p50_us", bench.Micros(d.Quantile(0.5)), bench.Micros(rl.Quantile(0.5)))
		r.report.relayRow("dial_2handshakes_p99_us", bench.Micros(d.Quantile(0.99)), bench.Micros(rl.Quantile(0.99)))
		r.report.relayRow("handshake_p50_us", bench.Micros(d.Quantile(0.5)), bench.Micros(handshakes.Quantile(0.5)))
		r.report.relayRow("handshake_p99_us", bench.Micros(d.Quantile(0.99)), bench.Micros(handshakes.Quantile(0.99)))
	}
}
