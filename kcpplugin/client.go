package kcpplugin

import (
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
)

// The transport settings of kcp's connection to the broker, the same as the
// broker's and the agent's own.
const (
	// WriteBufferSize is gRPC's write buffer: it flushes when full, so 256
	// KiB (its default is 32 KiB) makes one flush 16 TLS records, which
	// CoalesceWrites sends with one syscall. gRPC lends the buffer from a
	// pool while data waits, so an idle connection holds none.
	WriteBufferSize = 256 << 10
	// WindowSize and ConnWindowSize are fixed HTTP/2 flow-control windows
	// per stream (per tunnel) and per connection, like the broker's:
	// gRPC's dynamic windows send a PING with nearly every message of a
	// webhook call to measure the bandwidth.
	WindowSize     = 1 << 20
	ConnWindowSize = 16 << 20
	// serviceConfig spreads dials over every broker replica the target
	// resolves to: any replica routes any dial.
	serviceConfig = `{"loadBalancingConfig": [{"round_robin":{}}]}`
)

// DialOptions are the gRPC options for kcp's connection to the broker:
// creds (SPIFFE mTLS, e.g. go-spiffe's grpccredentials.MTLSClientCredentials)
// with coalesced writes, the write buffer, fixed windows and round robin
// over the replicas. NewClient uses them; they are here for callers that
// build the connection themselves.
func DialOptions(creds credentials.TransportCredentials) []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithTransportCredentials(CoalesceWrites(creds)),
		grpc.WithWriteBufferSize(WriteBufferSize),
		grpc.WithInitialWindowSize(WindowSize),
		grpc.WithInitialConnWindowSize(ConnWindowSize),
		grpc.WithDefaultServiceConfig(serviceConfig),
	}
}

// NewClient is kcp's connection to the broker replicas that target names,
// e.g. "dns:///tunnel-broker.kcp-system.svc:8443", with DialOptions(creds)
// and then opts, which may add to them or override them. Pass it to
// NewDialer; close it when kcp stops.
func NewClient(target string, creds credentials.TransportCredentials, opts ...grpc.DialOption) (*grpc.ClientConn, error) {
	return grpc.NewClient(target, append(DialOptions(creds), opts...)...)
}
