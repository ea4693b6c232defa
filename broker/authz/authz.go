// Package authz authorizes every RPC on the broker by the peer's SPIFFE ID,
// with go-grpc-middleware's auth interceptors. Finer checks (which clusters)
// happen in the services, against the same policy.
package authz

import (
	"context"
	"log/slog"
	"strings"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/auth"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
)

// Authorizer admits a peer to a method if the policy gives its SPIFFE ID a
// role that method needs.
type Authorizer struct {
	Policy *policy.Policy
	Log    *slog.Logger
}

// ServerOptions are the interceptors to install on the broker's server.
func (a *Authorizer) ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(auth.UnaryServerInterceptor(a.authorize)),
		grpc.ChainStreamInterceptor(auth.StreamServerInterceptor(a.authorize)),
	}
}

func (a *Authorizer) authorize(ctx context.Context) (context.Context, error) {
	method, _ := grpc.Method(ctx)
	id, ok := identity.PeerID(ctx)
	if !ok {
		return nil, status.Error(codes.Unauthenticated, "no SPIFFE ID")
	}
	if a.allowed(id, method) {
		return ctx, nil
	}
	metrics.Denied.WithLabelValues(method).Inc()
	a.Log.Warn("permission denied", "peer", id.String(), "method", method)
	// Say nothing about what exists: only who was refused what.
	return nil, status.Errorf(codes.PermissionDenied, "%s may not call %s", id, method)
}

func (a *Authorizer) allowed(id spiffeid.ID, method string) bool {
	p := a.Policy
	switch {
	case strings.HasPrefix(method, "/kcp.tunnel.v1.DialService/"):
		return p.IsCaller(id)
	case strings.HasPrefix(method, "/kcp.tunnel.v1.AgentService/"):
		return p.IsAgent(id)
	case strings.HasPrefix(method, "/kcp.tunnel.v1.AdminService/"):
		return p.IsOperator(id)
	case strings.HasPrefix(method, "/grpc.health.v1.Health/"), strings.HasPrefix(method, "/grpc.reflection."):
		// Anyone the policy knows may see that the broker is up and what
		// it serves; that says nothing about clusters.
		return p.IsCaller(id) || p.IsAgent(id) || p.IsOperator(id)
	}
	return false
}
