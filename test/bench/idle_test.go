package bench

import (
	"net"
	"testing"
	"time"
)

// BenchmarkIdleTunnel opens one connection per op, after one 64-byte round
// trip, and holds them all until the end; it reports what each one held
// then, after a garbage collection, across the whole process: Go stack
// bytes (stack-B/conn), heap bytes (heap-B/conn) and goroutines
// (goroutines/conn). In this process that is the caller, the broker, the
// agent and the echo target together; direct is the target's share alone,
// so tunnel minus direct is what an idle tunnel costs the broker, the agent
// and kcpplugin (tunnelbench's idle phase measures the broker and agent
// processes apart).
func BenchmarkIdleTunnel(b *testing.B) {
	for _, p := range paths {
		b.Run(p.name, func(b *testing.B) {
			dial(b, p.dial, "echo").Close() // warm up
			msg, buf := make([]byte, 64), make([]byte, 64)
			before := ReadUsage()
			conns := make([]net.Conn, 0, b.N)
			defer func() {
				for _, c := range conns {
					c.Close()
				}
			}()
			b.ResetTimer()
			for range b.N {
				c := dial(b, p.dial, "echo")
				conns = append(conns, c)
				_ = c.SetDeadline(time.Now().Add(time.Minute))
				if err := RoundTrip(c, msg, buf); err != nil {
					b.Fatal(err)
				}
				_ = c.SetDeadline(time.Time{})
			}
			b.StopTimer()
			after := ReadUsage()
			n := float64(len(conns))
			b.ReportMetric(float64(after.Stacks-before.Stacks)/n, "stack-B/conn")
			b.ReportMetric(float64(after.Heap-before.Heap)/n, "heap-B/conn")
			b.ReportMetric(float64(after.Goroutines-before.Goroutines)/n, "goroutines/conn")
		})
	}
}
