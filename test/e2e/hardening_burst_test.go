package e2e

import (
	"context"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// TestHardeningABurstOfDialsIsNotRefused: the bounds on streams waiting for
// their first message must not refuse ordinary dials, which send their
// target at once, even when thousands come together and gRPC reads many
// streams' headers before their targets.
func TestHardeningABurstOfDialsIsNotRefused(t *testing.T) {
	const burst = 3000
	env := harness.NewEnv(t)
	// Deadlines far above what the burst needs, so that only a refusal, not
	// a machine too loaded to answer 3000 dials in seconds, fails the test.
	_, addr := env.StartBrokerProcess("--max-pending-dials-per-cluster", "4000", "--dial-timeout", "1m")
	env.StartAgentProcess(addr, "/agent/sync-target-1", echoServices(harness.StartEcho(t)))
	kcp := env.Dialer(addr, "/kcp")
	harness.Eventually(t, 20*time.Second, "a first dial", func() bool { return dialEcho(kcp) == nil })

	// A few bursts: how gRPC interleaves headers and messages varies.
	for round := range 3 {
		var (
			wg    sync.WaitGroup
			mu    sync.Mutex
			codes = map[string]int{}
			first error
		)
		for range burst {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
				defer cancel()
				c, err := kcp.DialService(ctx, "root", "default", "echo", 80)
				if c != nil {
					c.Close()
				}
				mu.Lock()
				defer mu.Unlock()
				codes[status.Code(err).String()]++
				if err != nil && first == nil {
					first = err
				}
			}()
		}
		wg.Wait()
		if codes["OK"] != burst {
			t.Fatalf("burst %d, %d dials at once: %v; the first failure: %v", round, burst, codes, first)
		}
	}
}
