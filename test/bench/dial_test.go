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
