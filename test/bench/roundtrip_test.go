package bench

import (
	"net"
	"runtime"
	"testing"
	"time"
)

// BenchmarkRoundTrip64 is one 64-byte round trip per op on one connection to
// the echo target: the latency path through splice and pipe, both ways. It
// also reports the p50 and p99 of the round trips.
func BenchmarkRoundTrip64(b *testing.B) {
	for _, p := range paths {
		b.Run(p.name, func(b *testing.B) {
			c := dial(b, p.dial, "echo")
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(5 * time.Minute))
			msg, buf := make([]byte, 64), make([]byte, 64)
			for range 10 {
				if err := RoundTrip(c, msg, buf); err != nil {
					b.Fatal(err)
				}
			}
			s := make(Samples, 0, b.N)
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				start := time.Now()
				if err := RoundTrip(c, msg, buf); err != nil {
					b.Fatal(err)
				}
				s = append(s, time.Since(start))
			}
			b.StopTimer()
			b.ReportMetric(float64(s.Quantile(0.5)), "p50-ns")
			b.ReportMetric(float64(s.Quantile(0.99)), "p99-ns")
		})
	}
}

// BenchmarkRoundTrip64Parallel runs 64-byte round trips on 8 connections
// per CPU at once, each on its own connection (all tunnels share one gRPC
// connection per leg): ns/op is the inverse of the total rate.
func BenchmarkRoundTrip64Parallel(b *testing.B) {
	const perCPU = 8
	for _, p := range paths {
		b.Run(p.name, func(b *testing.B) {
			conns := make(chan net.Conn, perCPU*runtime.GOMAXPROCS(0))
			for range cap(conns) {
				c := dial(b, p.dial, "echo")
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(5 * time.Minute))
				conns <- c
			}
			b.SetParallelism(perCPU)
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				c := <-conns
				defer func() { conns <- c }()
				msg, buf := make([]byte, 64), make([]byte, 64)
				for pb.Next() {
					if err := RoundTrip(c, msg, buf); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}
