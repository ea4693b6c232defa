// Package server assembles the broker's gRPC server: mTLS with SPIFFE, the
// dial and agent services, health and reflection.
package server

import (
	"context"
	"log/slog"
	"net"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/reflection"

	agentv1 "github.com/kcp-dev/tunnel-broker/broker/api/agent/v1"
	dialv1 "github.com/kcp-dev/tunnel-broker/broker/api/dial/v1"
	"github.com/kcp-dev/tunnel-broker/broker/authz"
	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/broker/registry"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
)

// Config is what a broker replica needs.
type Config struct {
	// ID names this replica to agents and in logs.
	ID string
	// Identity is the broker's SVID and the bundles it trusts.
	Identity identity.SVIDSource
	// Policy says which SPIFFE IDs may do what.
	Policy      *policy.Policy
	DialTimeout time.Duration
	Log         *slog.Logger
}

// Server is one broker replica.
type Server struct {
	grpc     *grpc.Server
	health   *health.Server
	Registry *registry.Registry
}

// New builds a broker replica; Serve starts it.
func New(cfg Config) *Server {
	log := cfg.Log
	if log == nil {
		log = slog.Default()
	}
	reg := registry.New()
	authorizer := &authz.Authorizer{Policy: cfg.Policy, Log: log}
	// The handshake admits any SVID that chains to a trusted bundle; the
	// policy then decides per RPC, so a refused peer gets PermissionDenied,
	// not a bare TLS alert.
	creds := identity.LogRefusedHandshakes(identity.ServerCredentials(cfg.Identity, tlsconfig.AuthorizeAny()), log)
	opts := append(authorizer.ServerOptions(),
		grpc.Creds(creds),
		// Agents ping to notice a dead broker quickly; allow it.
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 5 * time.Second, PermitWithoutStream: true}),
		// And the broker pings idle agents, so a vanished agent is dropped in seconds.
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: 15 * time.Second, Timeout: 5 * time.Second}),
	)
	srv := grpc.NewServer(opts...)
	(&dialv1.Service{Registry: reg, Policy: cfg.Policy, Timeout: cfg.DialTimeout, Log: log.With("service", "dial")}).Register(srv)
	(&agentv1.Service{Registry: reg, Policy: cfg.Policy, BrokerID: cfg.ID, Log: log.With("service", "agent")}).Register(srv)
	hs := health.NewServer()
	healthpb.RegisterHealthServer(srv, hs)
	reflection.Register(srv)
	return &Server{grpc: srv, health: hs, Registry: reg}
}

// Serve serves on l until ctx ends, then stops: in-flight RPCs are cancelled.
func (s *Server) Serve(ctx context.Context, l net.Listener) error {
	stop := context.AfterFunc(ctx, func() {
		s.health.Shutdown()
		s.grpc.Stop()
	})
	defer stop()
	return s.grpc.Serve(l)
}
