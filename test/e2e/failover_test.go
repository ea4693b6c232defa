package e2e

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/resolver/manual"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/internal/identity"
	"github.com/kcp-dev/tunnel-broker/kcpplugin"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// replicas runs three broker binaries on 127.0.0.1-3, each on a port chosen
// up front so that a replica can be restarted where it was.
type replicas struct {
	env   *harness.Env
	addrs []string
	procs []*harness.Process
}

func startReplicas(t *testing.T, env *harness.Env) *replicas {
	r := &replicas{env: env}
	for i := range 3 {
		r.addrs = append(r.addrs, freeAddr(t, fmt.Sprintf("127.0.0.%d", i+1)))
		r.procs = append(r.procs, nil)
		r.start(i)
	}
	return r
}

func (r *replicas) start(i int) {
	p, _ := r.env.StartBrokerProcess("--listen", r.addrs[i], "--id", fmt.Sprintf("broker-%d", i), "--grace", "1s")
	r.procs[i] = p
}

func (r *replicas) list() string { return strings.Join(r.addrs, ",") }

func freeAddr(t *testing.T, host string) string {
	return net.JoinHostPort(host, strconv.Itoa(harness.FreePortOn(t, host)))
}

// callerConn is kcp's view: one ClientConn that balances over every replica.
func callerConn(t *testing.T, env *harness.Env, addrs []string) *grpc.ClientConn {
	r := manual.NewBuilderWithScheme("replicas")
	var state resolver.State
	for _, a := range addrs {
		state.Addresses = append(state.Addresses, resolver.Address{Addr: a})
	}
	r.InitialState(state)
	src := env.Identity("/kcp")
	conn, err := grpc.NewClient("replicas:///brokers",
		grpc.WithResolvers(r),
		grpc.WithDefaultServiceConfig(`{"loadBalancingConfig": [{"round_robin":{}}]}`),
		grpc.WithTransportCredentials(identity.ClientCredentials(src, tlsconfig.AuthorizeID(harness.ID("/broker")))))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// brokerDialer dials through one replica only.
func brokerDialer(env *harness.Env, addr string) *kcpplugin.Dialer {
	return waitingDialer(env.BrokerConn(addr, "/kcp"))
}

// traffic keeps a tunnel busy with round trips until stopped, and records
// how it ended.
type traffic struct {
	conn  net.Conn
	trips atomic.Int64
	err   error
	done  chan struct{}
}

func carry(conn net.Conn, stop <-chan struct{}) *traffic {
	tr := &traffic{conn: conn, done: make(chan struct{})}
	go func() {
		defer close(tr.done)
		buf := make([]byte, 64)
		msg := []byte(strings.Repeat("x", 63) + "\n")
		for {
			select {
			case <-stop:
				return
			default:
			}
			conn.SetDeadline(time.Now().Add(20 * time.Second))
			if _, err := conn.Write(msg); err != nil {
				tr.err = err
				return
			}
			if _, err := readFull(conn, buf); err != nil {
				tr.err = err
				return
			}
			tr.trips.Add(1)
			time.Sleep(5 * time.Millisecond)
		}
	}()
	return tr
}

func readFull(c net.Conn, b []byte) (int, error) {
	n := 0
	for n < len(b) {
		m, err := c.Read(b[n:])
		n += m
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

func TestFailoverBrokerReplicaDies(t *testing.T) {
	env := harness.NewEnv(t)
	r := startReplicas(t, env)
	echo := harness.StartEcho(t)
	services := lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: "root", Namespace: "default", Name: "echo", Ports: map[string]string{"80": echo}},
	}}
	env.StartAgentProcess(r.list(), "/agent/sync-target-1", services)
	env.StartAgentProcess(r.list(), "/agent/sync-target-2", services)

	// Every replica can route: each has both agents.
	for i, addr := range r.addrs {
		if err := dialEcho(brokerDialer(env, addr)); err != nil {
			t.Fatalf("dial through replica %d: %v", i, err)
		}
	}

	kcp := waitingDialer(callerConn(t, env, r.addrs))
	stop := make(chan struct{})
	tunnels := carryTunnels(t, 210, func() (net.Conn, error) { return dialEchoConn(kcp) }, stop, "every tunnel to carry traffic")

	r.procs[0].Kill()
	killed := time.Now()
	// New dials succeed through the survivors within 2 s.
	dialSoonAfterKill(t, kcp, killed)
	t.Logf("first dial through the survivors %v after the kill", time.Since(killed))

	// Tunnels on the dead replica ended with Unavailable; the others go on.
	waitEndedOrMoving(t, tunnels)
	ended, alive := 0, 0
	for _, tr := range tunnels {
		select {
		case <-tr.done:
			ended++
			if status.Code(tr.err) != codes.Unavailable {
				t.Errorf("a tunnel on the dead replica ended with %v, want Unavailable", tr.err)
			}
		default:
			alive++
		}
	}
	t.Logf("%d tunnels ended with their replica, %d carry on", ended, alive)
	if alive == 0 || ended == 0 {
		t.Fatalf("ended=%d alive=%d: tunnels should spread over the replicas", ended, alive)
	}

	// Restart the replica: agents reattach and it routes again.
	r.start(0)
	harness.Eventually(t, 20*time.Second, "agents to reattach to the restarted replica", func() bool {
		return dialEcho(brokerDialer(env, r.addrs[0])) == nil
	})
	close(stop)
	for _, tr := range tunnels {
		<-tr.done
	}
}

// dialSoonAfterKill dials echo through kcp until a dial succeeds, and
// fails the test if none did within 2 s of killed.
func dialSoonAfterKill(t *testing.T, kcp *kcpplugin.Dialer, killed time.Time) {
	t.Helper()
	ctx, cancel := context.WithDeadline(context.Background(), killed.Add(2*time.Second))
	defer cancel()
	for {
		err := dialEchoCtx(ctx, kcp)
		if err == nil {
			return
		}
		if ctx.Err() != nil {
			t.Fatalf("no dial succeeded within 2s of the replica's death: %v", err)
		}
	}
}

// carryTunnels opens n tunnels with dial, each carrying traffic until stop
// is closed, and waits (for what) until every one has made a round trip.
// The tunnels close when the test ends.
func carryTunnels(t *testing.T, n int, dial func() (net.Conn, error), stop chan struct{}, what string) []*traffic {
	t.Helper()
	var tunnels []*traffic
	for range n {
		conn, err := dial()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		tunnels = append(tunnels, carry(conn, stop))
	}
	harness.Eventually(t, 20*time.Second, what, func() bool {
		for _, tr := range tunnels {
			if tr.trips.Load() == 0 {
				return false
			}
		}
		return true
	})
	return tunnels
}

// waitEndedOrMoving waits until some tunnels have ended, and then until
// every tunnel has either ended or made progress since: after a replica
// died, its tunnels end and the others carry on.
func waitEndedOrMoving(t *testing.T, tunnels []*traffic) {
	t.Helper()
	harness.Eventually(t, 20*time.Second, "the dead replica's tunnels to end", func() bool {
		ended := 0
		for _, tr := range tunnels {
			select {
			case <-tr.done:
				ended++
			default:
			}
		}
		return ended > 0
	})
	before := map[*traffic]int64{}
	for _, tr := range tunnels {
		before[tr] = tr.trips.Load()
	}
	harness.Eventually(t, 20*time.Second, "every tunnel to have ended or made progress", func() bool {
		for _, tr := range tunnels {
			select {
			case <-tr.done:
			default:
				if tr.trips.Load() == before[tr] {
					return false
				}
			}
		}
		return true
	})
}

func TestFailoverAgentDies(t *testing.T) {
	env := harness.NewEnv(t)
	r := startReplicas(t, env)
	echo := harness.StartEcho(t)
	services := func(clusters ...string) lookup.StaticFile {
		var f lookup.StaticFile
		for _, c := range clusters {
			f.Services = append(f.Services, lookup.StaticService{Cluster: c, Namespace: "default", Name: "echo", Ports: map[string]string{"80": echo}})
		}
		return f
	}
	env.StartAgentProcess(r.list(), "/agent/sync-target-1", services("root"))
	solo := env.StartAgentProcess(r.list(), "/agent/sync-target-2", services("root", "solo"))
	kcp := waitingDialer(callerConn(t, env, r.addrs))

	stop := make(chan struct{})
	tunnels := carryTunnels(t, 20, func() (net.Conn, error) {
		return dialEchoConnCluster(context.Background(), kcp, "solo")
	}, stop, "tunnels to carry traffic")

	solo.Kill()
	// In-flight tunnels through it end with Unavailable.
	for _, tr := range tunnels {
		<-tr.done
		if status.Code(tr.err) != codes.Unavailable {
			t.Errorf("a tunnel through the dead agent ended with %v, want Unavailable", tr.err)
		}
	}
	// New dials for its cluster fail fast with Unavailable, not a timeout.
	for range 10 {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		err := dialEchoCtxCluster(ctx, kcp, "solo")
		cancel()
		if status.Code(err) != codes.Unavailable {
			t.Fatalf("dial for the dead agent's cluster: %v, want Unavailable", err)
		}
	}
	// The other cluster still works through the surviving agent.
	if err := dialEcho(kcp); err != nil {
		t.Fatalf("dial for root through the surviving agent: %v", err)
	}
	// It returns: dials succeed again.
	env.StartAgentProcess(r.list(), "/agent/sync-target-2", services("root", "solo"))
	harness.Eventually(t, 20*time.Second, "dials to the returned agent's cluster", func() bool {
		return dialEchoCtxCluster(context.Background(), kcp, "solo") == nil
	})
	close(stop)
}

func dialEcho(d *kcpplugin.Dialer) error { return dialEchoCtx(context.Background(), d) }

func dialEchoCtx(ctx context.Context, d *kcpplugin.Dialer) error {
	return dialEchoCtxCluster(ctx, d, "root")
}

func dialEchoCtxCluster(ctx context.Context, d *kcpplugin.Dialer, cluster string) error {
	conn, err := dialEchoConnCluster(ctx, d, cluster)
	if err != nil {
		return err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := conn.Write([]byte("ping\n")); err != nil {
		return err
	}
	buf := make([]byte, 5)
	if _, err := readFull(conn, buf); err != nil {
		return err
	}
	if string(buf) != "ping\n" {
		return errors.New("echo answered " + string(buf))
	}
	return nil
}

func dialEchoConn(d *kcpplugin.Dialer) (net.Conn, error) {
	return dialEchoConnCluster(context.Background(), d, "root")
}

func dialEchoConnCluster(ctx context.Context, d *kcpplugin.Dialer, cluster string) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	return d.DialService(ctx, cluster, "default", "echo", 80)
}
