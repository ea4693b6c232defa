package metrics

import (
	"google.golang.org/grpc"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// dataStreams are the RPCs that carry a tunnel's bytes: one message per
// write of the caller or the target, counted in bytes by BytesUp and
// BytesDown.
var dataStreams = map[string]bool{
	tunnelv1.DialService_Dial_FullMethodName:    true,
	tunnelv1.AgentService_Tunnel_FullMethodName: true,
}

// StreamServerInterceptor is GRPC's stream interceptor: it counts and times
// every stream, by method and code, and counts the messages of every stream
// but the data streams'. Counting a message costs a lookup of its series by
// four labels, about 5% of the broker's CPU on small round trips
// (docs/perf-history.md); the data streams' messages are the tunnel's
// writes, whose bytes the tunnel counts once per direction.
func StreamServerInterceptor() grpc.StreamServerInterceptor {
	counted := GRPC.StreamServerInterceptor()
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		if !dataStreams[info.FullMethod] {
			return counted(srv, ss, info, handler)
		}
		// The provider hands the handler a stream that counts each
		// message; the handler gets the stream itself instead.
		return counted(srv, ss, info, func(srv any, _ grpc.ServerStream) error { return handler(srv, ss) })
	}
}
