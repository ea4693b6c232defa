package tunnel_test

import (
	"github.com/kcp-dev/tunnel-broker/broker/admission"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"k8s.io/utils/clock"

	agentv1 "github.com/kcp-dev/tunnel-broker/broker/api/agent/v1"
	dialv1 "github.com/kcp-dev/tunnel-broker/broker/api/dial/v1"
	"github.com/kcp-dev/tunnel-broker/broker/internal/brokertest"
	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
)

// This file holds the broker the tests tunnel through: brokertest's real
// gRPC server on loopback with SPIFFE mTLS, serving the dial and agent
// services, whose handlers run the tunnels. The tests play kcp and the agent
// by hand (brokertest.Agent, brokertest.Tunnel).

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// The identities the tests use, as paths in brokertest.TrustDomain.
const (
	kcpPath   = "/kcp"   // may dial any cluster
	agentPath = "/agent" // may serve any cluster
)

var testPolicy = policy.File{
	Agents:  []policy.AgentRule{{ID: brokertest.ID(agentPath).String(), Clusters: []string{"*"}}},
	Callers: []policy.CallerRule{{ID: brokertest.ID(kcpPath).String()}},
}

// config is what a test changes in the broker.
type config struct {
	idleTimeout time.Duration
	// clock times the idle limit; nil: the real clock.
	clock clock.WithDelayedExecution
}

// broker is one broker under test.
type broker struct {
	*brokertest.Server
	admission *admission.Admission
}

func startBroker(t *testing.T, cfg config) *broker {
	t.Helper()
	b := &broker{}
	b.Server = brokertest.Start(t, testPolicy, func(s *brokertest.Server, srv *grpc.Server) {
		b.admission = admission.New(admission.Config{
			Registry: s.Registry, Policy: s.Policy, Timeout: testutil.WaitLong,
			Tunnels:  tunnel.Config{IdleTimeout: cfg.idleTimeout, Stopping: s.Stopping, Clock: cfg.clock},
			Draining: s.Draining, Log: s.Log,
		})
		dialv1.RegisterService(srv, dialv1.New(dialv1.Config{Admission: b.admission}))
		agentv1.RegisterService(srv, agentv1.New(agentv1.Config{
			Registry: s.Registry, Policy: s.Policy, BrokerID: "test-broker",
			Draining: s.Draining, Stopping: s.Stopping, Grace: time.Second,
			ProbeEvery: time.Hour, // no probes in these tests
			Log:        s.Log,
		}))
	})
	return b
}

// connectAgent registers an agent, as the identity agentPath, for clusters.
func (b *broker) connectAgent(t *testing.T, name string, clusters ...string) *brokertest.Agent {
	t.Helper()
	return b.ConnectAgent(t, agentPath, name, clusters...)
}
