package server

import (
	"log/slog"
	"testing"

	"github.com/kcp-dev/tunnel-broker/broker/authz"
	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/internal/devca"
)

func TestEveryServiceTheBrokerServesHasARole(t *testing.T) {
	ca, err := devca.New("test", "example.org")
	if err != nil {
		t.Fatal(err)
	}
	src, err := ca.Source(devca.Leaf{SPIFFEID: "/broker"})
	if err != nil {
		t.Fatal(err)
	}
	pol, err := policy.New(policy.File{
		Agents:  []policy.AgentRule{{ID: "spiffe://example.org/agent", Clusters: []string{"*"}}},
		Callers: []policy.CallerRule{{ID: "spiffe://example.org/kcp"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	s := New(Config{ID: "broker-0", Identity: src, Policy: pol, Log: slog.New(slog.DiscardHandler)})
	services := s.grpc.GetServiceInfo()
	if len(services) < 5 {
		t.Fatalf("the broker serves %d services, want its three, health and reflection", len(services))
	}
	for name := range services {
		if !authz.Knows(name) {
			t.Errorf("the broker serves %s, which no role may call", name)
		}
	}
}
