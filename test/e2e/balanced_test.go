package e2e

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"

	brokerreplicas "github.com/kcp-dev/tunnel-broker/broker/replicas"
	"github.com/kcp-dev/tunnel-broker/broker/server"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	"github.com/kcp-dev/tunnel-broker/kcpplugin"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/agent"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// An agent that reaches the replicas through one load balancer (a
// ServiceVIP here: round robin per connection, as a LoadBalancer Service
// is) holds one registration with each replica the brokers count, and
// follows a replica that leaves and one that comes; each replica routes
// dials to it, over Tunnel streams that reach the replica that ordered
// them.

// balancedReplicas are in-process broker replicas behind two VIPs, as the
// charts put them: the callers' lists those ready; the agents' lists each
// replica from its start until it is gone, ready or not (a Service with
// publishNotReadyAddresses), and the replicas count them by its endpoints,
// as by such a headless Service's name. A replica that no agent joins is
// ready after a second (--startup-grace).
type balancedReplicas struct {
	env *harness.Env
	vip *harness.ServiceVIP // the callers'
	// agents is the agents' load balancer.
	agents *harness.ServiceVIP
	ctx    context.Context
	mu     sync.Mutex // guards up, which the test's goroutine alone changes
	up     map[string]*harness.Broker
	// uncounted: the replicas do not count themselves (no --replicas-dns).
	uncounted bool
	// port, if set: replica i listens on 127.0.0.<10+i>:port, as pods
	// on one port at addresses of their own, which a DNS name can list.
	port  string
	count int // replicas started
}

func (r *balancedReplicas) start(id string, cfg func(*server.Config)) *harness.Broker {
	counter := &brokerreplicas.Counter{Name: "tunnel-broker-headless.kcp.svc", Every: 20 * time.Millisecond, Log: harness.Logger(),
		// The replicas' addresses, distinct as pod IPs are.
		LookupHost: func(context.Context, string) ([]string, error) { return r.agents.Endpoints(), nil }}
	listen := ""
	if r.port != "" {
		listen = fmt.Sprintf("127.0.0.%d:%s", 10+r.count, r.port)
	}
	r.count++
	b := r.env.StartBroker(harness.BrokerOptions{ID: id, Listen: listen, Config: func(c *server.Config) {
		c.StartupGrace = time.Second
		if !r.uncounted {
			c.Replicas = counter
		}
		if cfg != nil {
			cfg(c)
		}
	}})
	if !r.uncounted {
		go counter.Run(r.ctx)
	}
	r.mu.Lock()
	r.up[id] = b
	r.mu.Unlock()
	return b
}

// stop drains the replica and stops it; the agents' VIP and the count
// list it until it is gone.
func (r *balancedReplicas) stop(id string) {
	r.up[id].Stop()
	r.mu.Lock()
	delete(r.up, id)
	r.mu.Unlock()
}

// upNow is the replicas up, for another goroutine than the test's.
func (r *balancedReplicas) upNow() []*harness.Broker {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Collect(maps.Values(r.up))
}

// eachHoldsOne reports whether every replica up holds exactly one
// registration of the agent.
func (r *balancedReplicas) eachHoldsOne() bool {
	for _, b := range r.up {
		if len(b.Server.Registry.Agents()) != 1 {
			return false
		}
	}
	return true
}

func startBalanced(t *testing.T, cfg func(*server.Config), log *slog.Logger) (*balancedReplicas, *agent.Fleet) {
	return startBalancedReplicas(t, &balancedReplicas{}, cfg, log)
}

func startBalancedReplicas(t *testing.T, r *balancedReplicas, cfg func(*server.Config), log *slog.Logger) (*balancedReplicas, *agent.Fleet) {
	r.startN(t, 3, cfg)
	fleet, _ := r.startFleet(t, 20*time.Millisecond, log)
	return r, fleet
}

// startN starts n replicas, broker-0 to broker-<n-1>, behind one VIP,
// and waits until they are ready.
func (r *balancedReplicas) startN(t *testing.T, n int, cfg func(*server.Config)) {
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	r.env, r.vip, r.agents, r.ctx, r.up = harness.NewEnv(t), harness.StartServiceVIP(t), harness.StartServiceVIP(t), ctx, map[string]*harness.Broker{}
	t.Cleanup(r.followReadiness())
	for i := range n {
		r.start(fmt.Sprintf("broker-%d", i), cfg)
	}
	harness.Eventually(t, time.Minute, "every replica ready", func() bool { return len(r.vip.Endpoints()) == n })
}

// startFleet runs an agent fleet behind the VIP until stop, or the test's
// end.
func (r *balancedReplicas) startFleet(t *testing.T, seekEvery time.Duration, log *slog.Logger) (fleet *agent.Fleet, stop func()) {
	fleet = &agent.Fleet{
		LoadBalancer: r.agents.Addr,
		SeekEvery:    seekEvery,
		Log:          log,
		Agent:        echoAgents(t, r.env, log),
	}
	return fleet, runFleet(t, fleet)
}

// runFleet runs fleet until stop, or the test's end.
func runFleet(t *testing.T, fleet *agent.Fleet) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); fleet.Run(ctx) }()
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); <-done }) }
	// The fleet drains before the brokers stop (cleanups run last first).
	t.Cleanup(stop)
	return stop
}

func TestFailoverAgentBehindOneAddressHoldsEveryReplica(t *testing.T) {
	r, fleet := startBalanced(t, nil, harness.Logger())
	harness.Eventually(t, time.Minute, "one registration with each of the 3 replicas", func() bool {
		held, known := fleet.Registered()
		return r.eachHoldsOne() && held == 3 && known == 3 && fleet.Ready()
	})
	for id, b := range r.up {
		if err := dialEcho(r.env.Dialer(b.Addr, "/kcp")); err != nil {
			t.Errorf("dial through %s: %v", id, err)
		}
	}

	// A rollout: one replica leaves, a new one comes.
	r.stop("broker-1")
	r.start("broker-3", nil)
	harness.Eventually(t, time.Minute, "one registration with each of the 3 replicas up", func() bool {
		held, known := fleet.Registered()
		return r.eachHoldsOne() && held == 3 && known == 3
	})
	for id, b := range r.up {
		if err := dialEcho(r.env.Dialer(b.Addr, "/kcp")); err != nil {
			t.Errorf("dial through %s after the rollout: %v", id, err)
		}
	}
	// Scaled down, the fleet wants fewer.
	r.stop("broker-0")
	harness.Eventually(t, time.Minute, "readiness with the 2 replicas left", func() bool {
		held, known := fleet.Registered()
		return r.eachHoldsOne() && held == 2 && known == 2 && fleet.Ready()
	})
}

// Every --max-connection-age the broker asks for a new connection, which
// through the balancer may reach another replica. The agent's Tunnel
// streams must still reach the replica that ordered each dial: each member
// keeps to its connection, and before the broker asks, the fleet finds the
// member's replica on a new connection and lets the old one go. (Whether
// it finds it before the broker asks is a matter of time, which the test
// does not assert: it logs the dials that failed.)
func TestFailoverAgentBehindOneAddressMovesConnectionsBeforeTheirAge(t *testing.T) {
	var logs testutil.LogBuffer
	const age = 5 * time.Second
	r, fleet := startBalanced(t, func(c *server.Config) { c.MaxConnectionAge = age },
		slog.New(slog.NewTextHandler(&logs, nil)))
	harness.Eventually(t, time.Minute, "one registration with each of the 3 replicas", func() bool {
		held, _ := fleet.Registered()
		return held == 3
	})
	// For two connection ages, dial through every replica.
	deadline := time.Now().Add(2 * age)
	dialed, failed := 0, 0
	var lastErr error
	for time.Now().Before(deadline) {
		for _, b := range r.up {
			dialed++
			if err := dialEcho(r.env.Dialer(b.Addr, "/kcp")); err != nil {
				failed++
				lastErr = err
			}
		}
	}
	t.Logf("%d of %d dials failed while connections moved (last: %v)", failed, dialed, lastErr)
	if !strings.Contains(logs.String(), "nears its age: moving to a new one") {
		t.Errorf("no connection moved before its age; the agents' log:\n%s", logs.String())
	}
	harness.Eventually(t, time.Minute, "every replica held again", func() bool {
		held, known := fleet.Registered()
		return held == 3 && known == 3
	})
	for id, b := range r.up {
		if err := dialEcho(r.env.Dialer(b.Addr, "/kcp")); err != nil {
			t.Errorf("dial through %s: %v", id, err)
		}
	}
}

// Replicas that do not count themselves leave the agent unable to tell how
// many to reach: it holds the one it reached, and says why at ERROR.
func TestFailoverAgentBehindOneAddressSaysWhenTheBrokersDoNotCount(t *testing.T) {
	var logs testutil.LogBuffer
	_, fleet := startBalancedReplicas(t, &balancedReplicas{uncounted: true}, nil, slog.New(slog.NewTextHandler(&logs, nil)))
	harness.Eventually(t, time.Minute, "the agent to say the brokers do not count", func() bool {
		return strings.Contains(logs.String(), "level=ERROR msg=\"the broker does not count its replicas (its --replicas-dns is not set)")
	})
	if held, known := fleet.Registered(); held != 1 || known != 1 {
		t.Errorf("registered with %d of %d replicas, want the 1 it reached", held, known)
	}
}

// echoAgents makes the agents of a fleet, as /agent/sync-target-1, that
// serve root's default/echo:80, an echo server.
func echoAgents(t *testing.T, env *harness.Env, log *slog.Logger) func(addr string) *agent.Agent {
	resolver, err := lookup.NewStatic(lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: "root", Namespace: "default", Name: "echo", Ports: map[string]string{"80": harness.StartEcho(t)}},
	}})
	if err != nil {
		t.Fatal(err)
	}
	src := env.Identity("/agent/sync-target-1")
	return func(addr string) *agent.Agent {
		return &agent.Agent{
			Broker:      addr,
			Credentials: identity.ClientCredentials(src, tlsconfig.AuthorizeID(harness.ID("/broker"))),
			Name:        "sync-target-1",
			Resolver:    resolver,
			Grace:       time.Second,
			Log:         log,
		}
	}
}

// An agent given one address reaches every replica of 2, 3 and 5, at the
// default pace (a connection a second, while replicas are missing). Each
// start's time is logged: TUNNEL_BALANCED_STARTS starts per size (1 by
// default).
func TestFailoverAgentBehindOneAddressReachesEveryReplicaOf2_3And5(t *testing.T) {
	starts := 1
	if s, err := strconv.Atoi(os.Getenv("TUNNEL_BALANCED_STARTS")); err == nil && s > 0 {
		starts = s
	}
	for _, n := range []int{2, 3, 5} {
		t.Run(strconv.Itoa(n), func(t *testing.T) {
			r := &balancedReplicas{}
			r.startN(t, n, nil)
			var took []time.Duration
			for range starts {
				begin := time.Now()
				fleet, stop := r.startFleet(t, 0, harness.Logger())
				harness.Eventually(t, time.Minute, fmt.Sprintf("one registration with each of the %d replicas", n), func() bool {
					held, known := fleet.Registered()
					return r.eachHoldsOne() && held == n && known == n
				})
				took = append(took, time.Since(begin))
				stop()
				harness.Eventually(t, time.Minute, "every registration ended", func() bool {
					for _, b := range r.up {
						if len(b.Server.Registry.Agents()) != 0 {
							return false
						}
					}
					return true
				})
			}
			slices.Sort(took)
			t.Logf("%d replicas: every one held after p50 %v, max %v (%d starts)", n,
				took[len(took)/2].Round(time.Millisecond), took[len(took)-1].Round(time.Millisecond), starts)
		})
	}
}

// A scale-up from 2 to 3 replicas, then a rolling update of the first two,
// with the agent behind one address and kcp's dials at 50/s through the
// Service of the ready replicas: not one dial fails, and each new replica
// gets the agent before it is ready. Its --startup-grace is ten minutes
// off, so it turns ready only because the agent came (at least one
// registered, none for 3 s): behind a balancer of ready replicas only, it
// never would. Until it is ready kcp's dials do not reach it; a dial that
// reaches a draining replica is refused before any order and kcpplugin
// dials another.
func TestRestartScaleUpAndRolloutThroughOneAddressFailNoDial(t *testing.T) {
	r := &balancedReplicas{}
	r.startN(t, 2, nil)
	fleet, _ := r.startFleet(t, 0, harness.Logger())
	harness.Eventually(t, time.Minute, "one registration with each of the 2 replicas", func() bool {
		held, known := fleet.Registered()
		return r.eachHoldsOne() && held == 2 && known == 2
	})
	// kcp dials through the Service of the ready replicas.
	load := startDialLoad(kcpplugin.NewDialer(r.env.BrokerConn(r.vip.Addr, "/kcp")), "root")

	newReplica := func(id, step string) {
		begin := time.Now()
		b := r.start(id, func(c *server.Config) { c.StartupGrace = 10 * time.Minute })
		harness.Eventually(t, time.Minute, "the new replica "+id+" ready, its agent come", func() bool {
			return b.Server.Ready()
		})
		if n := len(b.Server.Registry.Agents()); n != 1 {
			t.Errorf("%s: the new replica is ready with %d registrations of the agent, want 1", step, n)
		}
		t.Logf("%s: the new replica ready, with the agent, %v after it started", step, time.Since(begin).Round(time.Millisecond))
	}
	newReplica("broker-2", "scale-up")
	// A rolling update of the first two: for each, a new replica, ready
	// and joined, then the old one drains.
	for i, old := range []string{"broker-0", "broker-1"} {
		newReplica(fmt.Sprintf("broker-%d", 3+i), "rollout")
		r.stop(old)
	}
	harness.Eventually(t, time.Minute, "one registration with each of the 3 replicas left", func() bool {
		held, known := fleet.Registered()
		return r.eachHoldsOne() && held == 3 && known == 3
	})
	time.Sleep(time.Second)
	load.finish()
	load.noneFailed(t, "", time.Time{}, "during the scale-up and the rollout")
}

// followReadiness keeps the callers' VIP to the replicas up whose
// readiness says ready, and the agents' to every replica up, polled every
// 50ms, until stop.
func (r *balancedReplicas) followReadiness() (stop func()) {
	done, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			var ready, up []string
			for _, b := range r.upNow() {
				up = append(up, b.Addr)
				if b.Server.NotReady() == nil {
					ready = append(ready, b.Addr)
				}
			}
			// In one order, so that the VIPs' round robin goes round.
			slices.Sort(ready)
			slices.Sort(up)
			r.vip.SetEndpoints(ready...)
			r.agents.SetEndpoints(up...)
			select {
			case <-done:
				return
			case <-tick.C:
			}
		}
	}()
	return func() { close(done); <-stopped }
}

// Before one address, agents in other clusters found the replicas by a DNS
// name under which external-dns published the pods' addresses. Such a name
// lags a rollout: external-dns syncs every minute, resolvers keep a record
// for its TTL, and a rollout's step takes about 70 s (the new replica
// ready at --startup-grace, then minReadySeconds). Here the name is one
// rollout behind: it lists the old replicas until the test publishes the
// new ones, 2 s after the last old one has gone. The rollout's steps are
// TestRestartScaleUpAndRolloutThroughOneAddressFailNoDial's, with kcp's
// dials at 50/s: from the last old replica's drain until the name catches
// up no replica holds the agent, and its cluster's dials fail (logged; the
// test holds that some were lost, so that the comparison stays true).
func TestRestartRolloutBehindLaggingPodAddressesLosesDials(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(lis.Addr().String())
	lis.Close()
	r := &balancedReplicas{uncounted: true, port: port}
	r.startN(t, 2, nil)

	var mu sync.Mutex
	published := r.agents.Endpoints()
	publish := func() { mu.Lock(); defer mu.Unlock(); published = r.agents.Endpoints() }
	fleet := &agent.Fleet{
		DNS:          "tunnel-broker.example.org:" + port,
		ResolveEvery: 100 * time.Millisecond,
		LookupHost: func(context.Context, string) ([]string, error) {
			mu.Lock()
			defer mu.Unlock()
			var ips []string
			for _, addr := range published {
				host, _, _ := net.SplitHostPort(addr)
				ips = append(ips, host)
			}
			return ips, nil
		},
		Log:   harness.Logger(),
		Agent: echoAgents(t, r.env, harness.Logger()),
	}
	runFleet(t, fleet)
	harness.Eventually(t, time.Minute, "one registration with each of the 2 replicas", func() bool {
		held, known := fleet.Registered()
		return r.eachHoldsOne() && held == 2 && known == 2
	})
	load := startDialLoad(kcpplugin.NewDialer(r.env.BrokerConn(r.vip.Addr, "/kcp")), "root")

	// A rollout: each new replica ready (no agent comes: at its
	// --startup-grace), then an old one drains.
	for i, old := range []string{"broker-0", "broker-1"} {
		b := r.start(fmt.Sprintf("broker-%d", 2+i), nil)
		harness.Eventually(t, time.Minute, "the new replica ready", b.Server.Ready)
		r.stop(old)
	}
	time.Sleep(2 * time.Second)
	publish()
	harness.Eventually(t, time.Minute, "the agent on the new replicas, once the name lists them", func() bool {
		held, _ := fleet.Registered()
		return r.eachHoldsOne() && held == 2
	})
	time.Sleep(time.Second)
	load.finish()
	failed, total := load.failed("", time.Time{}, time.Now())
	t.Logf("a rollout behind a DNS name one rollout late: %d of %d dials failed", len(failed), total)
	if len(failed) == 0 {
		t.Errorf("no dial failed while no replica held the agent: the test no longer shows what a lagging name costs")
	}
}
