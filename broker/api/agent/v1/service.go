// Package agent serves kcp.tunnel.v1.AgentService: agents register the
// logical clusters they serve on a control stream (connect.go), and open one
// Tunnel stream per dial the broker orders.
package agent

import (
	"cmp"
	"context"
	"log/slog"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/utils/clock"

	"github.com/kcp-dev/tunnel-broker/broker/internal/quota"
	"github.com/kcp-dev/tunnel-broker/broker/internal/receive"
	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/broker/registry"
	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// Defaults of Config.
const (
	// DefaultMaxRegistrations is how many control streams one agent
	// SPIFFE ID may hold with a replica: an agent holds one per replica it
	// reaches (with this one, one), and one more while it reconnects before
	// the broker has seen its old stream end.
	DefaultMaxRegistrations = 16
	// DefaultMaxClusters is how many logical clusters one registration may
	// serve: thousands of workspaces bound to one sync target fit.
	DefaultMaxClusters = 10000
	// DefaultRegistrationTimeout bounds the first registration, as the
	// broker's default --dial-timeout bounds every stream's first message.
	DefaultRegistrationTimeout = 5 * time.Second
	// DefaultProbeEvery is how often an agent is probed: often enough for
	// an alert within a minute, rare enough to cost nothing.
	DefaultProbeEvery = 10 * time.Second
	// DefaultMaxReregistrationsPerSecond paces the re-registrations of one
	// control stream (reregister.go): a workspace bound or unbound now and
	// then is put in force at once, a tight loop costs a few updates a
	// second.
	DefaultMaxReregistrationsPerSecond = 4
)

// Config is what the agent service needs. As in every Config of the broker,
// a zero value means the default, and a negative limit means none.
type Config struct {
	Registry *registry.Registry
	Policy   *policy.Policy
	// BrokerID names this replica to its agents.
	BrokerID string
	// Draining ends when the broker stops taking dials: agents are told,
	// with Grace as the time tunnels in flight still have. Stopping ends
	// when that time is over: control streams end. Nil: never.
	Draining, Stopping context.Context
	Grace              time.Duration
	// ProbeEvery is how often each agent is probed over its control
	// stream; zero: DefaultProbeEvery.
	ProbeEvery time.Duration
	// RegistrationTimeout bounds the first registration, all its Register
	// messages, from the control stream's start; zero or negative:
	// DefaultRegistrationTimeout.
	RegistrationTimeout time.Duration
	// MaxRegistrations bounds the control streams of one SPIFFE ID, each
	// counted from its start; zero: DefaultMaxRegistrations.
	MaxRegistrations int64
	// MaxClusters bounds the clusters of one registration; zero:
	// DefaultMaxClusters.
	MaxClusters int
	// MaxReregistrationsPerSecond paces the re-registrations of one
	// control stream, the latest list winning; zero:
	// DefaultMaxReregistrationsPerSecond.
	MaxReregistrationsPerSecond float64
	// MaxConnectionAge is how long after a connection's start the broker
	// asks its client to move to a new one (zero: never); agents hear it
	// with their registration.
	MaxConnectionAge time.Duration
	// Replicas, if set, counts the broker's replicas (replicas.Counter):
	// each agent hears the count after its registration and again when it
	// changes, so that agents behind one address know how many to reach.
	Replicas interface {
		Count() (n int, changed <-chan struct{})
	}
	// Clock times the probes, the first registration and the end of each
	// registration at its SVID's expiry; nil: the real clock.
	Clock clock.WithTickerAndDelayedExecution
	Log   *slog.Logger
}

// Service implements AgentService.
type Service struct {
	tunnelv1.UnimplementedAgentServiceServer

	cfg           Config
	registrations quota.Quota // control streams, per agent SPIFFE ID
}

// New is an agent service with cfg, its defaults resolved.
func New(cfg Config) *Service {
	if cfg.Draining == nil {
		cfg.Draining = context.Background()
	}
	if cfg.Stopping == nil {
		cfg.Stopping = context.Background()
	}
	cfg.ProbeEvery = cmp.Or(max(cfg.ProbeEvery, 0), DefaultProbeEvery)
	cfg.RegistrationTimeout = cmp.Or(max(cfg.RegistrationTimeout, 0), DefaultRegistrationTimeout)
	cfg.MaxClusters = cmp.Or(cfg.MaxClusters, DefaultMaxClusters)
	cfg.MaxReregistrationsPerSecond = cmp.Or(cfg.MaxReregistrationsPerSecond, DefaultMaxReregistrationsPerSecond)
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	cfg.Log = cmp.Or(cfg.Log, slog.Default())
	return &Service{
		cfg:           cfg,
		registrations: quota.Quota{PerID: cmp.Or(cfg.MaxRegistrations, DefaultMaxRegistrations)},
	}
}

// RegisterService registers s on srv.
func RegisterService(srv grpc.ServiceRegistrar, s *Service) {
	tunnelv1.RegisterAgentServiceServer(srv, s)
}

// Tunnel implements AgentService.Tunnel: the first message names the dial,
// which the stream then carries until the tunnel's end (package tunnel).
func (s *Service) Tunnel(stream tunnelv1.AgentService_TunnelServer) error {
	id, ok := identity.PeerID(stream.Context())
	if !ok {
		return status.Error(codes.Unauthenticated, "no SPIFFE ID")
	}
	first, err := receive.First[tunnelv1.TunnelRequest](stream, "stream closed before naming its dial")
	if err != nil {
		return err
	}
	open := first.GetOpen()
	if open == nil {
		return status.Error(codes.InvalidArgument, "the first message on a tunnel must name its dial")
	}
	return tunnel.Open(s.cfg.Registry, open.GetDialId(), id, stream)
}
