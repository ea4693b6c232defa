package kcpplugin

import (
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// serviceConfig spreads dials over every broker replica the target resolves
// to: any replica routes any dial.
const serviceConfig = `{"loadBalancingConfig": [{"round_robin":{}}]}`

// DialOptions are the gRPC options for kcp's connection to the broker:
// creds (SPIFFE mTLS, e.g. go-spiffe's grpccredentials.MTLSClientCredentials)
// with the transport settings the broker and the agent use too (the write
// buffer and fixed windows: wire.DialOptions), and round
// robin over the replicas. NewClient uses them; they are here for callers
// that build the connection themselves.
func DialOptions(creds credentials.TransportCredentials) []grpc.DialOption {
	return append(wire.DialOptions(creds), grpc.WithDefaultServiceConfig(serviceConfig))
}

// NewClient is kcp's connection to the broker replicas that target names,
// e.g. "dns:///tunnel-broker.kcp-system.svc:8443", with DialOptions(creds)
// and then opts, which may add to them or override them. Pass it to
// NewDialer; close it when kcp stops.
func NewClient(target string, creds credentials.TransportCredentials, opts ...grpc.DialOption) (*grpc.ClientConn, error) {
	return grpc.NewClient(target, append(DialOptions(creds), opts...)...)
}
