package tunnel

import (
	"google.golang.org/grpc"

	"github.com/kcp-dev/tunnel-broker/internal/splice"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// Leg is one end of a tunnel as the broker carries it: the caller's (a
// Dial stream, or a connection of the CONNECT front end) or the agent's (a
// Tunnel stream). The agent carries its side of the tunnel with the same
// legs and the same splice (package splice).
type Leg = splice.Leg

// CallerStream is the Dial stream of a caller as its tunnel's leg.
func CallerStream(stream grpc.ServerStream) *splice.ServerStreamLeg {
	return splice.ServerStream(stream, &tunnelv1.DialResponse{Frame: &tunnelv1.DialResponse_CloseWrite{CloseWrite: &tunnelv1.CloseWrite{}}})
}

// AgentStream is the Tunnel stream of an agent as its tunnel's leg.
func AgentStream(stream grpc.ServerStream) *splice.ServerStreamLeg {
	return splice.ServerStream(stream, &tunnelv1.TunnelResponse{Frame: &tunnelv1.TunnelResponse_CloseWrite{CloseWrite: &tunnelv1.CloseWrite{}}})
}
