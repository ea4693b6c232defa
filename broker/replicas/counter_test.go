package replicas

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kcp-dev/tunnel-broker/internal/testutil"
)

// names is a DNS stand-in whose answer the test sets.
type names struct {
	mu    sync.Mutex
	addrs []string
	err   error
	asked chan struct{}
}

func (n *names) set(err error, addrs ...string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.addrs, n.err = addrs, err
}

func (n *names) lookup(_ context.Context, host string) ([]string, error) {
	n.mu.Lock()
	addrs, err := n.addrs, n.err
	n.mu.Unlock()
	defer func() { n.asked <- struct{}{} }()
	if host != "tunnel-broker-headless.kcp.svc" {
		return nil, errors.New("no such host " + host)
	}
	return addrs, err
}

func startCounter(t *testing.T, n *names) (*Counter, *clocktesting.FakeClock, *testutil.LogBuffer) {
	clk := clocktesting.NewFakeClock(time.Now())
	var logs testutil.LogBuffer
	c := &Counter{Name: "tunnel-broker-headless.kcp.svc", Every: time.Second, LookupHost: n.lookup, Clock: clk,
		Log: slog.New(slog.NewTextHandler(&logs, nil))}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		c.Run(ctx)
	}()
	// Each lookup the clock causes is waited for, so at the end Run waits
	// on its ticker.
	t.Cleanup(func() {
		cancel()
		<-done
	})
	testutil.Wait(t, "the first lookup", n.asked)
	return c, clk, &logs
}

// resolveAgain steps the clock to the next lookup and waits for it.
func resolveAgain(t *testing.T, clk *clocktesting.FakeClock, n *names) {
	t.Helper()
	testutil.Eventually(t, "the counter waiting for its ticker", clk.HasWaiters)
	clk.Step(time.Second)
	testutil.Wait(t, "the next lookup", n.asked)
}

func TestCounterCountsDistinctAddressesAndSaysWhenTheCountChanges(t *testing.T) {
	n := &names{asked: make(chan struct{})}
	n.set(nil, "10.0.0.1", "10.0.0.2", "10.0.0.2")
	c, clk, _ := startCounter(t, n)
	// A lookup's answer counts once its call has returned: wait for that.
	testutil.Eventually(t, "a count of 2, from two addresses (one twice)", func() bool { count, _ := c.Count(); return count == 2 })
	_, changed := c.Count()

	// The next lookup starts only once the one before is counted.
	resolveAgain(t, clk, n)
	resolveAgain(t, clk, n)
	select {
	case <-changed:
		t.Fatal("changed closed while the count stayed 2")
	default:
	}

	n.set(nil, "10.0.0.1", "10.0.0.2", "10.0.0.3")
	resolveAgain(t, clk, n)
	testutil.Wait(t, "changed to close when a third replica is ready", changed)
	if count, _ := c.Count(); count != 3 {
		t.Errorf("count %d, want 3", count)
	}
}

func TestCounterKeepsTheLastCountWhenTheNameDoesNotResolve(t *testing.T) {
	n := &names{asked: make(chan struct{})}
	n.set(nil, "10.0.0.1", "10.0.0.2")
	c, clk, logs := startCounter(t, n)
	testutil.Eventually(t, "a count of 2", func() bool { count, _ := c.Count(); return count == 2 })
	_, changed := c.Count()

	n.set(errors.New("server misbehaving"))
	resolveAgain(t, clk, n)
	resolveAgain(t, clk, n)
	n.set(nil)
	resolveAgain(t, clk, n)
	// The lookup after the last one starts only once it is counted.
	resolveAgain(t, clk, n)
	if count, _ := c.Count(); count != 2 {
		t.Errorf("count %d after failed lookups, want the last one, 2", count)
	}
	select {
	case <-changed:
		t.Error("changed closed by failed lookups")
	default:
	}
	if got := strings.Count(logs.String(), "cannot count the broker's replicas"); got != 1 {
		t.Errorf("said %d times that it cannot count, want once until a lookup succeeds:\n%s", got, logs)
	}
}

func TestCounterIsZeroUntilTheNameFirstResolves(t *testing.T) {
	n := &names{asked: make(chan struct{})}
	n.set(errors.New("no such host"))
	c, _, _ := startCounter(t, n)
	if count, _ := c.Count(); count != 0 {
		t.Errorf("count %d before any lookup succeeded, want 0 (unknown)", count)
	}
}
