package e2e

import (
	"context"
	"io"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/broker/registry"
	"github.com/kcp-dev/tunnel-broker/broker/server"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	"github.com/kcp-dev/tunnel-broker/kcpplugin"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"

	promtestutil "github.com/prometheus/client_golang/prometheus/testutil"
)

// TestFailoverLimits: past each limit a caller gets ResourceExhausted (or,
// for an idle tunnel, DeadlineExceeded), the limit is counted, and what is
// within the limits goes on.
func TestFailoverLimits(t *testing.T) {
	t.Run("tunnels per caller", limitTunnelsPerCaller)
	t.Run("pending dials per cluster", limitPendingDialsPerCluster)
	t.Run("idle timeout", limitIdleTimeout)
	t.Run("message size", limitMessageSize)
}

// limitHits is how many times the broker counted hitting limit.
func limitHits(limit string) float64 {
	return promtestutil.ToFloat64(metrics.LimitsHit.WithLabelValues(limit))
}

// startLimited starts a broker configured by limit, and an agent that
// serves echo in root. Each limit gets a broker of its own, so that one's
// tunnels do not count against another's.
func startLimited(t *testing.T, limit func(*server.Config)) (*harness.Env, *harness.Broker, *kcpplugin.Dialer) {
	env := harness.NewEnv(t)
	b := env.StartBroker(harness.BrokerOptions{DialTimeout: 2 * time.Second, Config: limit})
	echo := harness.StartEcho(t)
	env.StartAgent(b.Addr, "/agent/sync-target-1", lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: "root", Namespace: "default", Name: "echo", Ports: map[string]string{"80": echo}},
	}})
	return env, b, env.Dialer(b.Addr, "/kcp")
}

func limitTunnelsPerCaller(t *testing.T) {
	_, _, kcp := startLimited(t, func(c *server.Config) { c.MaxTunnelsPerCaller = 2 })
	before := limitHits("tunnels_per_caller")
	first, err := dialEchoConn(kcp)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	second, err := dialEchoConn(kcp)
	if err != nil {
		t.Fatal(err)
	}
	_, err = dialEchoConn(kcp)
	testutil.CheckStatus(t, "third tunnel", err, codes.ResourceExhausted, "already holds 2 tunnels")
	if got := limitHits("tunnels_per_caller") - before; got != 1 {
		t.Errorf("limit counted %v times, want 1", got)
	}
	// The next dial works as soon as one tunnel closes.
	second.Close()
	harness.Eventually(t, 10*time.Second, "a dial after a tunnel closed", func() bool {
		c, err := dialEchoConn(kcp)
		if err == nil {
			c.Close()
		}
		return err == nil
	})
}

func limitPendingDialsPerCluster(t *testing.T) {
	env, b, kcp := startLimited(t, func(c *server.Config) { c.Limits = registry.Limits{MaxPendingPerCluster: 1} })
	orders := startSilentAgent(t, env, b.Addr, "silent-cluster")
	before := limitHits(registry.LimitPendingPerCluster)
	pending := make(chan error, 1)
	go func() { pending <- dialEchoCtxCluster(context.Background(), kcp, "silent-cluster") }()
	<-orders // the first dial waits on the agent now
	err := dialEchoCtxCluster(context.Background(), kcp, "silent-cluster")
	testutil.CheckStatus(t, "second dial", err, codes.ResourceExhausted, "1 of its dials pending")
	testutil.CheckStatus(t, "first dial", <-pending, codes.DeadlineExceeded, "did not connect in time")
	if limitHits(registry.LimitPendingPerCluster) <= before {
		t.Error("the pending-dial limit was not counted")
	}
}

func limitIdleTimeout(t *testing.T) {
	_, _, kcp := startLimited(t, func(c *server.Config) { c.IdleTimeout = 300 * time.Millisecond })
	before := limitHits("idle_timeout")
	conn, err := dialEchoConn(kcp)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	roundTrip(t, conn, "before idling")
	conn.SetReadDeadline(time.Now().Add(20 * time.Second))
	_, err = io.ReadAll(conn)
	testutil.CheckStatus(t, "idle tunnel", err, codes.DeadlineExceeded, "carried nothing for 300ms")
	if got := limitHits("idle_timeout") - before; got != 1 {
		t.Errorf("idle timeout counted %v times, want 1", got)
	}
}

func limitMessageSize(t *testing.T) {
	env, b, _ := startLimited(t, func(c *server.Config) { c.MaxMessageSize = 64 << 10 })
	raw := tunnelv1.NewDialServiceClient(env.BrokerConn(b.Addr, "/kcp"))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	stream, err := raw.Dial(ctx)
	if err != nil {
		t.Fatal(err)
	}
	stream.Send(&tunnelv1.DialRequest{Frame: &tunnelv1.DialRequest_Target{Target: &tunnelv1.Target{Cluster: "root", Namespace: "default", Service: "echo", Port: 80}}})
	if msg, err := stream.Recv(); err != nil || msg.GetEstablished() == nil {
		t.Fatalf("dial: %v %v", msg, err)
	}
	stream.Send(&tunnelv1.DialRequest{Frame: &tunnelv1.DialRequest_Data{Data: make([]byte, 128<<10)}})
	for err == nil {
		_, err = stream.Recv()
	}
	testutil.CheckStatus(t, "oversized frame", err, codes.ResourceExhausted, "larger than max")
}
