package authz

import (
	"log/slog"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/broker/metrics"
)

// What a peer the policy refused asked for: the label asked of
// kcp_tunnel_broker_denied_total, and of the refusal's log line.
const (
	// AskedCall: an RPC of a service its role does not cover.
	AskedCall = "call"
	// AskedServe: logical clusters to serve (an agent's Register).
	AskedServe = "serve"
	// AskedDial: a tunnel to a logical cluster (a Dial).
	AskedDial = "dial"
	// AskedEgress: a CONNECT, from a SPIFFE ID with no egress rule.
	AskedEgress = "egress"
)

// Deny is the one way the broker refuses a request by policy: it counts
// the refusal by what was asked, logs who was refused what, and returns
// PermissionDenied with reason, which names only the peer and what it
// asked, nothing of what exists. The CONNECT front end answers it as 403.
func Deny(log *slog.Logger, peer, asked, reason string, attrs ...any) error {
	metrics.Denied.WithLabelValues(asked).Inc()
	log.Warn("permission denied", append([]any{"peer", peer, "asked", asked, "reason", reason}, attrs...)...)
	return status.Error(codes.PermissionDenied, reason)
}
