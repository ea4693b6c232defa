// Package kcpplugin lets kcp's webhook client reach Services in the clusters
// that run a logical cluster's webhooks (a provider's service cluster),
// through the tunnel broker, with TLS running end to end from kcp to the
// webhook.
package kcpplugin

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
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

// Dialer opens tunnels with the broker's Dial RPC, one Dial stream each.
type Dialer struct {
	client tunnelv1.DialServiceClient
	// state is the connection's state, if it tells it (a *grpc.ClientConn
	// does).
	state interface{ GetState() connectivity.State }
	// Timeout bounds each dial, from the call to a usable connection.
	Timeout time.Duration
	// EarlyData, on by default, makes DialService return the connection at
	// once, before the broker has established the tunnel, and send the
	// connection's first Write (up to wire.MaxEarlyData bytes of it) with
	// the dial; the rest of that Write, and any later one, waits for the
	// broker's answer: a TLS ClientHello leaves with the target instead of a round
	// trip later, which saves that round trip on every new connection. A
	// dial that fails then surfaces on the first Read or Write, with the
	// status DialService would have returned (status.Code works on it), and
	// Timeout still bounds it. Off, DialService waits for the tunnel.
	EarlyData bool
}

var _ ServiceDialer = (*Dialer)(nil)

// NewDialer returns a ServiceDialer that uses the broker's Dial RPC over
// conn, with EarlyData on. The caller builds conn with its own transport
// credentials (SPIFFE mTLS), NewClient for instance, and closes it when
// done: that ends every tunnel on it.
func NewDialer(conn grpc.ClientConnInterface) *Dialer {
	state, _ := conn.(interface{ GetState() connectivity.State })
	return &Dialer{client: tunnelv1.NewDialServiceClient(conn), state: state, Timeout: DefaultDialTimeout, EarlyData: true}
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
	ctx, span := startDialSpan(ctx, target)
	c, err := d.open(ctx, target, timeout, span)
	if err != nil {
		endDialSpan(span, "", err)
		// A nil *conn in a net.Conn would not be nil to the caller.
		return nil, err
	}
	if d.EarlyData {
		return c, nil
	}
	if err := c.waitEstablished(ctx); err != nil {
		return nil, err
	}
	return c, nil
}

// open starts a dial of target on a Dial stream of its own. The stream
// waits for a ready connection to a broker replica, within timeout and ctx:
// after a broker restart the dial goes out as soon as kcp's connection is
// back, instead of failing at once while gRPC waits to reconnect.
func (d *Dialer) open(ctx context.Context, target *tunnelv1.Target, timeout time.Duration, span trace.Span) (*conn, error) {
	start := time.Now()
	// The stream outlives the dial, so it must not die with ctx; the dial
	// is bounded by timeout, and a dial that waits also by ctx.
	streamCtx, cancel := context.WithCancel(withTraceContext(context.WithoutCancel(ctx), span))
	var timedOut atomic.Bool
	giveUp := time.AfterFunc(timeout, func() { timedOut.Store(true); cancel() })
	stopWaiting := context.AfterFunc(ctx, cancel)
	stream, err := d.client.Dial(streamCtx, grpc.ForceCodecV2(sendCodec{wire.FrameCodec()}), grpc.WaitForReady(true))
	giveUp.Stop()
	stopWaiting()
	if err == nil && streamCtx.Err() != nil {
		err = streamCtx.Err() // opened as the wait ran out
	}
	switch {
	case err == nil:
		return newConn(stream, cancel, target, timeout, timeout-time.Since(start), span), nil
	case (timedOut.Load() || errors.Is(ctx.Err(), context.DeadlineExceeded)) && d.waitedForABroker():
		// No broker was ready before the dial's timeout or deadline: say
		// why, in words, from gRPC's last connection error, which its
		// message names with the broker's address (kcp shows this
		// message to its end users; gRPC's own log keeps the address).
		err = status.Errorf(codes.Unavailable, "no tunnel broker reachable within %v: %s", time.Since(start).Round(time.Millisecond), connectionFailure(err))
	case timedOut.Load():
		err = status.Errorf(codes.DeadlineExceeded, "the dial's stream did not open within %v", timeout)
	case ctx.Err() != nil:
		err = status.FromContextError(ctx.Err()).Err()
	}
	cancel()
	return nil, err
}

// waitedForABroker tells whether a dial that ran out of time waited for a
// ready connection to a broker, rather than for a stream that a ready
// broker was slow to open: only the first is "no tunnel broker reachable".
func (d *Dialer) waitedForABroker() bool {
	return d.state != nil && d.state.GetState() != connectivity.Ready
}

// A conn's dial goes in two steps. Its target is sent with the conn's first
// Write (carrying that Write's first bytes as early data, so that a TLS
// ClientHello needs no round trip of its own), or its first Read or
// CloseWrite if one comes first. The broker then answers with established,
// or ends the stream with the dial's failure, within the dial's timeout.
// Dialer.DialService sends the target at once and waits for that answer,
// unless Dialer.EarlyData lets the conn's first Read or Write meet it.

// The outcomes of a dial. A dial that fails otherwise ends its stream.
const (
	dialing int32 = iota
	dialEstablished
	dialTimedOut
)

// dialState is a conn's dial until the broker answers it.
type dialState struct {
	// mu guards target, and keeps the target's Send apart from Write's.
	mu sync.Mutex
	// target is what the dial names, until it is sent (or abandoned).
	target *tunnelv1.Target

	timeout time.Duration
	timer   *time.Timer // ends the dial when timeout passes unanswered
	outcome atomic.Int32
	// answered is closed when the broker has established the tunnel or the
	// dial has failed; err is the failure, set before.
	answered chan struct{}
	err      error
	// span is the dial's (trace.go), ended as the dial is answered.
	span trace.Span
}

// sendTarget sends the dial's target, with up to wire.MaxEarlyData bytes of
// early as early data, if it has not gone yet; it returns how much of early
// went. A failed send is reported as Send reports it (io.EOF: the stream's
// status says why).
func (c *conn) sendTarget(early []byte) (int, error) {
	c.dial.mu.Lock()
	defer c.dial.mu.Unlock()
	if c.dial.target == nil {
		return 0, nil
	}
	early = early[:min(len(early), wire.MaxEarlyData)]
	err := c.stream.Send(&tunnelv1.DialRequest{Frame: &tunnelv1.DialRequest_Target{Target: c.dial.target}, EarlyData: early})
	c.dial.target = nil
	if err != nil {
		return 0, err
	}
	return len(early), nil
}

// abandon forgets a target that has not been sent; true if it had not.
func (d *dialState) abandon() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	unsent := d.target != nil
	d.target = nil
	return unsent
}

// waitEstablished sends the target and waits until the broker establishes
// the tunnel, the dial fails, or ctx ends; on an error the conn is done.
func (c *conn) waitEstablished(ctx context.Context) error {
	if _, err := c.sendTarget(nil); err != nil && !errors.Is(err, io.EOF) {
		c.cancel()
		<-c.received
		return err
	}
	select {
	case <-c.dial.answered:
	case <-ctx.Done():
		c.cancel()
		<-c.received
		return status.FromContextError(ctx.Err()).Err()
	}
	if c.dial.err != nil {
		<-c.received
		return c.dial.err
	}
	return nil
}

// dialTimedOut ends a dial that is still unanswered when its timeout passes.
func (c *conn) dialTimedOut() {
	if c.dial.outcome.CompareAndSwap(dialing, dialTimedOut) {
		c.cancel()
	}
}

// answer takes the broker's first message on the stream, which must be
// established.
func (r *receiver) answer(f *wire.Frame) {
	var msg tunnelv1.DialResponse
	err := f.Decode(&msg)
	f.Free()
	switch {
	case r.protocolErr != nil:
		// The stream is being cancelled for a protocol error: whatever
		// follows, an established included, changes nothing.
	case err == nil && msg.GetEstablished() != nil:
		if r.dial.outcome.CompareAndSwap(dialing, dialEstablished) {
			r.dial.timer.Stop()
			endDialSpan(r.dial.span, msg.GetEstablished().GetTunnelId(), nil)
			close(r.dial.answered)
		}
		// Otherwise the timeout came first and has cancelled the stream:
		// its end is the dial's failure.
	default:
		r.protocolErr = status.Errorf(codes.Internal, "protocol error: broker answered a dial with %T", msg.GetFrame())
		r.cancel()
	}
}

// dialFailure is what the end of the stream before established means: the
// dial's status, which must not be OK.
func (r *receiver) dialFailure(err error) error {
	switch {
	case r.dial.outcome.Load() == dialTimedOut:
		return status.Errorf(codes.DeadlineExceeded, "dial %s timed out after %v", r.remote, r.dial.timeout)
	case errors.Is(err, io.EOF):
		return status.Error(codes.Internal, "protocol error: broker ended a dial without answering")
	}
	// gRPC wraps the last replica's status once its retries on others are
	// exhausted ("max retries exhausted: ..."): the caller sees that
	// status, as a replica sent it.
	var replica interface{ GRPCStatus() *status.Status }
	if errors.As(err, &replica) {
		return replica.GRPCStatus().Err()
	}
	return err
}

// unanswered is true until the broker has established the tunnel or the
// dial has failed.
func (d *dialState) unanswered() bool { return !isClosed(d.answered) }

// fail ends an unanswered dial with err.
func (d *dialState) fail(err error) {
	d.err = err
	endDialSpan(d.span, "", err)
	close(d.answered)
}
