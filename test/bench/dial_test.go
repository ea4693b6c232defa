package bench

import (
	"testing"
	"time"
)

// BenchmarkDial is one dial per op, closed right after: for tunnel, the Dial
// RPC, the broker's order to the agent, the agent's TCP connect and Tunnel
// stream, until established (no TLS inside). It also reports p50 and p99.
func BenchmarkDial(b *testing.B) {
	for _, p := range paths {
		b.Run(p.name, func(b *testing.B) {
			dial(b, p.dial, "echo").Close() // warm up
			s := make(Samples, 0, b.N)
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				start := time.Now()
				c := dial(b, p.dial, "echo")
				s = append(s, time.Since(start))
				c.Close()
			}
			b.StopTimer()
			b.ReportMetric(float64(s.Quantile(0.5)), "p50-ns")
			b.ReportMetric(float64(s.Quantile(0.99)), "p99-ns")
		})
	}
}

// BenchmarkDialFirstEcho is one dial and its first 64-byte round trip per
// op, closed right after: what tunnelbench's dial_first_echo figures
// measure across processes, and what a peer's dial is compared on (a dial
// can return before its far end has connected; a round trip cannot). It
// also reports p50 and p99. tunnel_early sends the 64 bytes with the dial.
func BenchmarkDialFirstEcho(b *testing.B) {
	for _, p := range append(paths[:len(paths):len(paths)], earlyPath) {
		b.Run(p.name, func(b *testing.B) { dialFirstEcho(b, p, 0) })
	}
}

// BenchmarkDialFirstEchoPaced is BenchmarkDialFirstEcho at a webhook
// client's pace, 50 ms between ops, as tunnelbench's paced phase: each
// dial finds the processes idle, as a webhook call does. The pauses count
// in ns/op, so that -benchtime bounds the whole run: read p50-ns and
// p99-ns.
func BenchmarkDialFirstEchoPaced(b *testing.B) {
	for _, p := range []benchPath{paths[0], earlyPath} {
		b.Run(p.name, func(b *testing.B) { dialFirstEcho(b, p, 50*time.Millisecond) })
	}
}

// dialFirstEcho times a dial and its first round trip per op on p, with
// pause before each.
func dialFirstEcho(b *testing.B, p benchPath, pause time.Duration) {
	msg, buf := make([]byte, 64), make([]byte, 64)
	dial(b, p.dial, "echo").Close() // warm up
	s := make(Samples, 0, b.N)
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		time.Sleep(pause)
		start := time.Now()
		c := dial(b, p.dial, "echo")
		_ = c.SetDeadline(time.Now().Add(time.Minute))
		if err := RoundTrip(c, msg, buf); err != nil {
			b.Fatal(err)
		}
		s = append(s, time.Since(start))
		c.Close()
	}
	b.StopTimer()
	b.ReportMetric(float64(s.Quantile(0.5)), "p50-ns")
	b.ReportMetric(float64(s.Quantile(0.99)), "p99-ns")
}
