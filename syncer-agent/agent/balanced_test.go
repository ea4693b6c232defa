package agent

import (
	"context"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// runBalanced runs a fleet behind one address whose connections reach the
// fake brokers as pick says, each counting len(brokers) replicas, until
// the test ends.
func runBalanced(t *testing.T, n int, pick func(i int64) int, logs *testutil.LogBuffer) (*Fleet, []*fakeBroker) {
	return runCounted(t, n, n, pick, logs)
}

// runCounted is runBalanced with brokers that count count replicas.
func runCounted(t *testing.T, n, count int, pick func(i int64) int, logs *testutil.LogBuffer) (*Fleet, []*fakeBroker) {
	t.Helper()
	p := newPKI(t)
	var brokers []*fakeBroker
	for range n {
		b := startBroker(t, p)
		b.replicas = count
		brokers = append(brokers, b)
	}
	var connections atomic.Int64
	log := slog.New(slog.NewTextHandler(logs, nil))
	f := &Fleet{
		LoadBalancer: "tunnel.example.org:8443",
		SeekEvery:    time.Millisecond,
		Log:          log,
		Agent: func(string) *Agent {
			// The balancer: this connection's replica.
			a := newAgent(t, p, brokers[pick(connections.Add(1)-1)], staticResolver(t, "127.0.0.1:1"))
			a.Log = log
			return a
		},
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = f.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return f, brokers
}

func TestAFleetBehindOneAddressHoldsEveryReplicaItsBalancerReaches(t *testing.T) {
	var logs testutil.LogBuffer
	f, _ := runBalanced(t, 3, func(i int64) int { return int(i % 3) }, &logs)
	testutil.Eventually(t, "registrations with the 3 replicas", func() bool {
		held, known := f.Registered()
		return held == 3 && known == 3 && f.Ready()
	})
	if strings.Contains(logs.String(), "pin") {
		t.Errorf("a round-robin balancer taken for one that pins:\n%s", logs.String())
	}
}

func TestAFleetBehindABalancerThatPinsItSaysSo(t *testing.T) {
	var logs testutil.LogBuffer
	f, _ := runBalanced(t, 2, func(int64) int { return 0 }, &logs)
	testutil.Eventually(t, "the fleet to say the balancer may pin it", func() bool {
		return strings.Contains(logs.String(), "connections in a row reached broker replicas this agent holds already: does the load balancer pin a client to one replica")
	})
	// The registration and the count it is measured against may still be
	// settling when the warning is logged (a loaded machine showed 1 of 1).
	testutil.Eventually(t, "the fleet to hold 1 of the 2 replicas and say so in its readiness", func() bool {
		held, known := f.Registered()
		err := f.NotReady()
		return held == 1 && known == 2 && err != nil && strings.Contains(err.Error(), "registered with 1 of the 2 broker replicas behind tunnel.example.org:8443")
	})
}

func TestAFleetBehindOneAddressTakesACountOf100AtMost(t *testing.T) {
	var logs testutil.LogBuffer
	f, _ := runCounted(t, 1, 1<<31, func(int64) int { return 0 }, &logs)
	testutil.Eventually(t, "the count heard", func() bool { _, known := f.Registered(); return known > 1 })
	if held, known := f.Registered(); held != 1 || known != maxReplicas {
		t.Errorf("registered with %d of %d replicas, want 1 of %d", held, known, maxReplicas)
	}
}

func TestAFleetBehindOneAddressKeepsAReplicaThatDrainsUntilItGoes(t *testing.T) {
	var logs testutil.LogBuffer
	f, brokers := runBalanced(t, 2, func(i int64) int { return int(i % 2) }, &logs)
	testutil.Eventually(t, "registrations with the 2 replicas", func() bool {
		held, known := f.Registered()
		return held == 2 && known == 2
	})
	drain := &tunnelv1.ConnectResponse{Message: &tunnelv1.ConnectResponse_Drain{Drain: &tunnelv1.Drain{GraceMs: 20000}}}
	for _, b := range brokers {
		b.nextSession(t).send(t, drain)
	}
	testutil.Eventually(t, "both drains heard", func() bool { return strings.Count(logs.String(), "broker is draining") == 2 })
	// The brokers count both replicas until they go: a fleet that looked
	// for others in their place would have connected again within a few
	// of its 1ms waits.
	time.Sleep(200 * time.Millisecond)
	for i, b := range brokers {
		if n := len(b.sessions); n > 0 {
			t.Errorf("replica %d got %d more registrations after it drained, want none", i, n)
		}
	}
	if held, known := f.Registered(); held != 2 || known != 2 {
		t.Errorf("registered with %d of %d replicas, want 2 of 2", held, known)
	}
}
