package dial

import (
	"github.com/kcp-dev/tunnel-broker/broker/admission"
	"log/slog"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"

	agentv1 "github.com/kcp-dev/tunnel-broker/broker/api/agent/v1"
	"github.com/kcp-dev/tunnel-broker/broker/internal/brokertest"
	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// This file holds the broker the tests dial through: brokertest's real gRPC
// server on loopback with SPIFFE mTLS from a throwaway CA, serving the
// DialService under test, its dial connections, and the AgentService its
// tunnels need. The tests
// play kcp and the agent by hand with the generated clients.

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// The identities the tests use, as paths in brokertest.TrustDomain.
const (
	kcpPath   = "/kcp"   // may dial any cluster
	shardPath = "/shard" // may dial team-a only
	agentPath = "/agent" // may serve any cluster
)

var testPolicy = policy.File{
	Agents: []policy.AgentRule{{ID: brokertest.ID(agentPath).String(), Clusters: []string{"*"}}},
	Callers: []policy.CallerRule{
		{ID: brokertest.ID(kcpPath).String()},
		{ID: brokertest.ID(shardPath).String(), Clusters: []string{"team-a"}},
	},
}

// config is what a test changes in the broker.
type config struct {
	timeout             time.Duration
	maxTunnelsPerCaller int64
	// maxEarlyDataPerCaller and maxEarlyData bound pending dials' early
	// data.
	maxEarlyDataPerCaller, maxEarlyData int64
	// log, if set, takes the dial service's log as JSON lines.
	log *testutil.LogBuffer
}

const brokerID = "test-broker"

// broker is one broker under test, serving the DialService under test and the
// AgentService its tunnels need.
type broker struct {
	*brokertest.Server
	dial *Service
}

func startBroker(t *testing.T, cfg config) *broker {
	t.Helper()
	if cfg.timeout == 0 {
		cfg.timeout = testutil.WaitLong
	}
	b := &broker{}
	b.Server = brokertest.Start(t, testPolicy, func(s *brokertest.Server, srv *grpc.Server) {
		log := s.Log
		if cfg.log != nil {
			log = slog.New(slog.NewJSONHandler(cfg.log, &slog.HandlerOptions{Level: slog.LevelDebug}))
		}
		b.dial = New(Config{Admission: admission.New(admission.Config{
			Registry: s.Registry, Policy: s.Policy, Timeout: cfg.timeout,
			MaxTunnelsPerCaller:   cfg.maxTunnelsPerCaller,
			MaxEarlyDataPerCaller: cfg.maxEarlyDataPerCaller, MaxEarlyData: cfg.maxEarlyData,
			Tunnels:  tunnel.Config{Stopping: s.Stopping},
			Draining: s.Draining, BrokerID: brokerID, Log: log,
		})})
		RegisterService(srv, b.dial)
		agentv1.RegisterService(srv, agentv1.New(agentv1.Config{
			Registry: s.Registry, Policy: s.Policy, BrokerID: brokerID,
			Draining: s.Draining, Stopping: s.Stopping, Grace: time.Second,
			ProbeEvery: time.Hour, // no probes in these tests
			Log:        s.Log,
		}))
	})
	return b
}

// dialStatus dials target as caller and returns the status the dial ends with.
func (b *broker) dialStatus(t *testing.T, caller string, target *tunnelv1.Target) error {
	t.Helper()
	stream, _ := b.StartDial(t, caller, target)
	msg, err := stream.Recv()
	if err == nil {
		t.Fatalf("dial of %v answered %v, want an error", target, msg)
	}
	return err
}

// connectAgent registers an agent, as the identity agentPath, for clusters.
func (b *broker) connectAgent(t *testing.T, name string, clusters ...string) *brokertest.Agent {
	t.Helper()
	return b.ConnectAgent(t, agentPath, name, clusters...)
}
