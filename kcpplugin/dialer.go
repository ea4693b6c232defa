// Package kcpplugin lets kcp's webhook client reach Services in the physical
// clusters behind its sync targets, through the tunnel broker, with TLS
// running end to end from kcp to the webhook.
package kcpplugin

import (
	"context"
	"errors"
	"io"
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

// Dialer opens tunnels with the broker's Dial RPC.
type Dialer struct {
	client tunnelv1.DialServiceClient
	// Timeout bounds each dial, from the call to a usable connection.
	Timeout time.Duration
}

var _ ServiceDialer = (*Dialer)(nil)

// NewDialer returns a ServiceDialer that uses the broker's Dial RPC over conn.
// The caller builds conn with its own transport credentials (SPIFFE mTLS).
func NewDialer(conn grpc.ClientConnInterface) *Dialer {
	return &Dialer{client: tunnelv1.NewDialServiceClient(conn), Timeout: DefaultDialTimeout}
}

// DialService opens a tunnel to port of Service namespace/name in cluster.
// Errors carry the broker's gRPC status (status.Code works on them):
// InvalidArgument, Unavailable, NotFound, DeadlineExceeded, PermissionDenied,
// ResourceExhausted.
func (d *Dialer) DialService(ctx context.Context, cluster, namespace, name string, port int32) (net.Conn, error) {
	if port < 1 || port > 65535 {
		return nil, status.Errorf(codes.InvalidArgument, "port %d is outside 1-65535", port)
	}
	target := &tunnelv1.Target{Cluster: cluster, Namespace: namespace, Service: name, Port: uint32(port)}
	if err := target.Validate(); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}

	// The stream outlives the dial, so it must not die with ctx; the dial's
	// own wait is bounded by ctx and Timeout below.
	streamCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	timeout := d.Timeout
	if timeout <= 0 {
		timeout = DefaultDialTimeout
	}
	dialCtx, dialDone := context.WithTimeout(ctx, timeout)
	defer dialDone()
	stopWatch := context.AfterFunc(dialCtx, cancel)

	c, err := d.open(streamCtx, target)
	if !stopWatch() {
		// dialCtx ended first and cancelled the stream.
		cancel()
		if errors.Is(dialCtx.Err(), context.DeadlineExceeded) && ctx.Err() == nil {
			return nil, status.Errorf(codes.DeadlineExceeded, "dial %s timed out after %v", target.Key(), timeout)
		}
		if ctx.Err() != nil {
			return nil, status.FromContextError(ctx.Err()).Err()
		}
	}
	if err != nil {
		cancel()
		return nil, err
	}
	return newConn(c, cancel, addr(target.Key())), nil
}

// open sends the target and waits for the broker's answer.
func (d *Dialer) open(ctx context.Context, target *tunnelv1.Target) (tunnelv1.DialService_DialClient, error) {
	stream, err := d.client.Dial(ctx, wire.FrameCallOption())
	if err != nil {
		return nil, err
	}
	if err := stream.Send(&tunnelv1.DialRequest{Frame: &tunnelv1.DialRequest_Target{Target: target}}); err != nil {
		// Send reports io.EOF; the reason is the stream's status.
		if _, err := stream.Recv(); err != nil {
			return nil, answerError(err)
		}
		return nil, status.Error(codes.Internal, "protocol error: broker answered a dial it did not read")
	}
	first, err := stream.Recv()
	if err != nil {
		return nil, answerError(err)
	}
	if first.GetEstablished() == nil {
		return nil, status.Errorf(codes.Internal, "protocol error: broker answered a dial with %T", first.GetFrame())
	}
	return stream, nil
}

// answerError is the error for a dial whose stream ended before the broker
// answered: its status, which must not be OK.
func answerError(err error) error {
	if errors.Is(err, io.EOF) {
		return status.Error(codes.Internal, "protocol error: broker ended a dial without answering")
	}
	return err
}
