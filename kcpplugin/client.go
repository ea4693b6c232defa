package kcpplugin

import (
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials"
)

// serviceConfig spreads dials over every broker replica the target resolves
// to: any replica routes any dial. A dial a replica refuses with
// Unavailable before it ordered anything (it drains, or no agent of the
// cluster has joined it yet) is sent again, at once, to the next replica:
// gRPC retries it, with the first message and its early data, until a
// replica takes it or four more have refused. A replica that may have
// reached the target stops the retry (docs/protocol.md, "Retrying a dial on
// another replica").
const serviceConfig = `{
  "loadBalancingConfig": [{"round_robin": {}}],
  "methodConfig": [{
    "name": [{"service": "kcp.tunnel.v1.DialService", "method": "Dial"}],
    "retryPolicy": {
      "maxAttempts": 5,
      "initialBackoff": "0.01s",
      "maxBackoff": "0.1s",
      "backoffMultiplier": 2,
      "retryableStatusCodes": ["UNAVAILABLE"]
    }
  }]
}`

// reconnect is how kcp's connection to a replica comes back after it broke:
// at most a second between attempts, so that a dial, which waits for a
// ready replica within its timeout (Dialer.Timeout), finds one about a
// second after one is back, however long the outage. There are few kcp
// processes: the brokers do not need them to wait longer.
var reconnect = grpc.ConnectParams{
	Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second},
	MinConnectTimeout: 5 * time.Second,
}

// DialOptions are the gRPC options for kcp's connection to the broker:
// creds (SPIFFE mTLS, e.g. go-spiffe's grpccredentials.MTLSClientCredentials)
// with the transport settings the broker and the agent use too (the write
// buffer and fixed windows: wire.DialOptions), round robin over the
// replicas, a dial retried on another replica that could not serve it, and
// reconnection within a second of a replica's return. NewClient uses them; they are here for callers
// that build the connection themselves. They also record why the
// connection's last attempt failed, by the error's type, for the words of a
// dial that found no broker (words.go): they dial with a dialer of their
// own (so gRPC uses no HTTPS_PROXY for the connection) and wrap creds. Each
// call records one connection: build one ClientConn with it.
func DialOptions(creds credentials.TransportCredentials) []grpc.DialOption {
	return append(new(connRecord).options(creds), grpc.WithDefaultServiceConfig(serviceConfig), grpc.WithConnectParams(reconnect))
}

// NewClient is kcp's connection to the broker replicas that target names,
// e.g. "dns:///tunnel-broker.kcp-system.svc:8443", with DialOptions(creds)
// and then opts, which may add to them or override them. Pass it to
// NewDialer; close it when kcp stops.
func NewClient(target string, creds credentials.TransportCredentials, opts ...grpc.DialOption) (*grpc.ClientConn, error) {
	return grpc.NewClient(target, append(DialOptions(creds), opts...)...)
}
