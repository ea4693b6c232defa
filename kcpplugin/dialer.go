// Package kcpplugin lets kcp's webhook client reach Services in the physical
// clusters behind its sync targets, through the tunnel broker, with TLS
// running end to end from kcp to the webhook.
package kcpplugin

import (
	"context"
	"net"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// DefaultDialTimeout bounds a dial when the caller's context sets no shorter
// deadline. Go's HTTP transport dials with a context that is never cancelled,
// so without it a dial could wait forever.
const DefaultDialTimeout = 10 * time.Second

// ServiceDialer opens a byte stream to a Service in a logical cluster.
type ServiceDialer interface {
	DialService(ctx context.Context, cluster, namespace, name string, port int32) (net.Conn, error)
}

// Dialer opens tunnels with the broker's Dial RPC, or on dial connections
// (WithDialConnections).
type Dialer struct {
	client tunnelv1.DialServiceClient
	spares *spares // nil without dial connections
	// live are the tunnels on dial connections, shared by copies of the
	// Dialer (a copy that sets EarlyData, say) as spares are.
	live *liveConns
	// Timeout bounds each dial, from the call to a usable connection.
	Timeout time.Duration
	// EarlyData makes DialService return the connection at once, before the
	// broker has established the tunnel, and send the connection's first
	// Write (up to wire.MaxEarlyData bytes of it) with the dial: a TLS
	// ClientHello leaves with the target instead of a round trip later,
	// which saves that round trip on every new connection. A dial that
	// fails then surfaces on the first Read or Write, with the status
	// DialService would have returned (status.Code works on it), and
	// Timeout still bounds it. Off, DialService waits for the tunnel.
	EarlyData bool
}

var _ ServiceDialer = (*Dialer)(nil)

// NewDialer returns a ServiceDialer that uses the broker's Dial RPC over conn,
// with opts. The caller builds conn with its own transport credentials
// (SPIFFE mTLS). Close it when done.
func NewDialer(conn grpc.ClientConnInterface, opts ...Option) *Dialer {
	d := &Dialer{client: tunnelv1.NewDialServiceClient(conn), Timeout: DefaultDialTimeout}
	for _, opt := range opts {
		opt(d)
	}
	return d
}

// Close closes the Dialer's dial connections: those it keeps ahead of its
// dials, and those its tunnels ride on, which end as the tunnels on the
// gRPC connection's streams end when that connection closes (a reset, even
// for a tunnel whose end exchange is under way). It returns once nothing
// of them runs. The gRPC connection is its owner's to close.
func (d *Dialer) Close() error {
	d.live.closeAll()
	d.spares.Close()
	return nil
}

// DialService opens a tunnel to port of Service namespace/name in cluster.
// Errors carry the broker's gRPC status (status.Code works on them):
// InvalidArgument, Unavailable, NotFound, DeadlineExceeded, PermissionDenied,
// ResourceExhausted. With EarlyData, only the first is returned here, and
// the others by the connection's first Read or Write.
func (d *Dialer) DialService(ctx context.Context, cluster, namespace, name string, port int32) (net.Conn, error) {
	if port < 1 || port > 65535 {
		return nil, status.Errorf(codes.InvalidArgument, "port %d is outside 1-65535", port)
	}
	target := &tunnelv1.Target{Cluster: cluster, Namespace: namespace, Service: name, Port: uint32(port)}
	if err := target.Validate(); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	if err := ctx.Err(); err != nil {
		return nil, status.FromContextError(err).Err()
	}
	timeout := d.Timeout
	if timeout <= 0 {
		timeout = DefaultDialTimeout
	}
	c, err := d.open(ctx, target, timeout)
	if err != nil || d.EarlyData {
		return c, err
	}
	if err := c.waitEstablished(ctx); err != nil {
		return nil, err
	}
	return c, nil
}

// dialingConn is a tunnel's conn whose dial the broker has not answered
// yet: on a dial connection, or on a Dial stream.
type dialingConn interface {
	net.Conn
	waitEstablished(ctx context.Context) error
}

// open starts a dial of target on a spare dial connection if there is
// one, else on a Dial stream.
func (d *Dialer) open(ctx context.Context, target *tunnelv1.Target, timeout time.Duration) (dialingConn, error) {
	if s := d.spares.Take(); s != nil {
		c := newDirectConn(s, target, timeout, d.spares, d.live)
		if !d.live.add(c) {
			c.Close()
			return nil, status.Error(codes.Canceled, "the dialer is closed")
		}
		return c, nil
	}
	// The stream outlives the dial, so it must not die with ctx; the dial
	// is bounded by timeout, and a dial that waits also by ctx.
	streamCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	stream, err := d.client.Dial(streamCtx, wire.FrameCallOption())
	if err != nil {
		cancel()
		return nil, err
	}
	return newConn(stream, cancel, target, timeout), nil
}
