// Package authz authorizes every RPC on the broker by the peer's SPIFFE ID,
// with go-grpc-middleware's auth interceptors. Finer checks (which clusters)
// happen in the services, against the same policy.
package authz

import (
	"context"
	"fmt"
	"log/slog"
	"strings"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/auth"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	reflectionv1 "google.golang.org/grpc/reflection/grpc_reflection_v1"
	reflectionv1alpha "google.golang.org/grpc/reflection/grpc_reflection_v1alpha"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// A role says whether the policy lets a SPIFFE ID call a service.
type role func(p *policy.Policy, id spiffeid.ID) bool

// roles says who may call each service of the broker, by the name its
// generated ServiceDesc gives it: a service that is renamed stops compiling
// here, rather than being refused to everyone. A service that is not here
// is refused to everyone.
var roles = map[string]role{
	tunnelv1.DialService_ServiceDesc.ServiceName:  (*policy.Policy).IsCaller,
	tunnelv1.AgentService_ServiceDesc.ServiceName: (*policy.Policy).IsAgent,
	tunnelv1.AdminService_ServiceDesc.ServiceName: (*policy.Policy).IsOperator,
	// Anyone the policy knows may see that the broker is up and what it
	// serves; that says nothing about clusters.
	healthpb.Health_ServiceDesc.ServiceName:                    anyRole,
	reflectionv1.ServerReflection_ServiceDesc.ServiceName:      anyRole,
	reflectionv1alpha.ServerReflection_ServiceDesc.ServiceName: anyRole,
}

func anyRole(p *policy.Policy, id spiffeid.ID) bool {
	return p.IsCaller(id) || p.IsAgent(id) || p.IsOperator(id)
}

// Knows reports whether service, by its full name, has a role: every
// service the broker serves must.
func Knows(service string) bool {
	_, ok := roles[service]
	return ok
}

// Authorizer admits a peer to a method if the policy gives its SPIFFE ID
// the role of the method's service.
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
	return nil, Deny(a.Log, id.String(), AskedCall, fmt.Sprintf("%s may not call %s", id, method), "method", method)
}

// allowed reports whether id may call method, a full method name
// ("/package.Service/Method").
func (a *Authorizer) allowed(id spiffeid.ID, method string) bool {
	name, slash := strings.CutPrefix(method, "/")
	service, _, ok := strings.Cut(name, "/")
	may, known := roles[service]
	return slash && ok && known && may(a.Policy, id)
}
