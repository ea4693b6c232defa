package e2e

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/kcp-dev/tunnel-broker/syncer-agent/agent"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// TestFailoverAgentFollowsDNS: an agent given a DNS name (a headless
// Service) joins every replica the name resolves to, joins a replica that
// appears, and leaves one that vanishes from the answer.
func TestFailoverAgentFollowsDNS(t *testing.T) {
	env := harness.NewEnv(t)
	port := freePortOnAll(t, "127.0.0.1", "127.0.0.2")
	b1 := env.StartBroker(harness.BrokerOptions{ID: "broker-1", Listen: "127.0.0.1:" + port})
	b2 := env.StartBroker(harness.BrokerOptions{ID: "broker-2", Listen: "127.0.0.2:" + port})

	var mu sync.Mutex
	answer := []string{"127.0.0.1"}
	setAnswer := func(ips ...string) { mu.Lock(); answer = ips; mu.Unlock() }
	fleet := &agent.Fleet{
		DNS:          "tunnel-broker-headless.kcp-system.svc:" + port,
		ResolveEvery: 50 * time.Millisecond,
		LookupHost: func(_ context.Context, host string) ([]string, error) {
			mu.Lock()
			defer mu.Unlock()
			return append([]string(nil), answer...), nil
		},
		Log:   harness.Logger(),
		Agent: echoAgents(t, env, harness.Logger()),
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); fleet.Run(ctx) }()
	defer func() { cancel(); <-done }()

	agents := func(b *harness.Broker) int { return len(b.Server.Registry.Agents()) }
	harness.Eventually(t, 10*time.Second, "the agent on the replica DNS names", func() bool { return agents(b1) == 1 && fleet.Ready() })
	if agents(b2) != 0 {
		t.Fatal("the agent joined a replica DNS did not name")
	}
	setAnswer("127.0.0.1", "127.0.0.2")
	harness.Eventually(t, 10*time.Second, "the agent to join the new replica", func() bool { return agents(b1) == 1 && agents(b2) == 1 })
	harness.Eventually(t, 10*time.Second, "readiness with both", func() bool { r, k := fleet.Registered(); return r == 2 && k == 2 })
	setAnswer("127.0.0.2")
	harness.Eventually(t, 10*time.Second, "the agent to leave the vanished replica", func() bool { return agents(b1) == 0 && agents(b2) == 1 })
	if err := dialEcho(env.Dialer(b2.Addr, "/kcp")); err != nil {
		t.Fatalf("dial through the replica that stayed: %v", err)
	}
}

// freePortOnAll finds a port free on every host, for replicas that share a
// port on several addresses, as pods behind a headless Service do.
func freePortOnAll(t *testing.T, hosts ...string) string {
	return strconv.Itoa(harness.FreePortOn(t, hosts...))
}
