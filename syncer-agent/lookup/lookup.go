// Package lookup maps a dial target (logical cluster, namespace, Service,
// port) to the addresses the agent may connect to. The agent dials nothing
// a Resolver did not return.
package lookup

import (
	"context"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// Resolver finds the endpoints of a target. Errors are gRPC statuses the
// caller can act on: NotFound for no such Service or port, Unavailable for a
// Service without ready endpoints, PermissionDenied for a refused target.
type Resolver interface {
	// Resolve returns host:port addresses, best first.
	Resolve(ctx context.Context, t *tunnelv1.Target) ([]string, error)
	// Clusters are the logical clusters this resolver serves.
	Clusters() []string
}

// ClusterWatcher is a Resolver whose set of clusters changes over time, e.g.
// as workspaces bind to the agent's sync target. The agent re-registers with
// the new set each time the channel fires.
type ClusterWatcher interface {
	// ClustersChanged receives a value after Clusters changed. It is
	// buffered: changes that come while nobody listens collapse into one.
	ClustersChanged() <-chan struct{}
}
