package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/internal/redact"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// defaultConnectTimeout applies when an order carries no timeout.
const defaultConnectTimeout = 5 * time.Second

// maxFailureMessage bounds a dial_failure's message, in bytes: the broker
// shows its callers no more of it (docs/protocol.md §5).
const maxFailureMessage = 256

// open answers one dial order up to its pipe: connect to the target, then
// open the tunnel's Tunnel stream to the broker; or report why not, and
// return nil. What it returns is the rest of the tunnel's life: write the
// order's early data to the target, pipe, and clean up. The early data
// goes only after the open, so that a dial whose early data reached a
// target is one the broker has claimed, or one it is told not to order
// again (docs/protocol.md §3.4).
//
// What it reports may reach kcp's end users in admission errors: a short
// reason in words, without addresses. The details stay in the agent's log,
// under the tunnel id, which the broker's log and the caller's message name
// too.
func (a *Agent) open(ctx context.Context, client tunnelv1.AgentServiceClient, order *tunnelv1.DialOrder, fail func(*tunnelv1.DialFailure)) (run func()) {
	d := a.newDialed(order)
	d.report = func(code codes.Code, message string, earlySent bool) {
		fail(&tunnelv1.DialFailure{DialId: d.id, Code: int32(code), Message: redacted(message),
			EarlyDataSent: earlySent && len(d.early) > 0})
	}
	if err := a.dialTarget(ctx, d, order); err != nil {
		d.report(err.code, err.message, false)
		return nil
	}
	return openStream(ctx, client, d, a.stalledWriteTimeout())
}

// newDialed is the dial of order before it connects, with a log that
// names its tunnel id and target.
func (a *Agent) newDialed(order *tunnelv1.DialOrder) *dialed {
	t := order.GetTarget()
	return &dialed{
		id: order.GetDialId(),
		log: a.Log.With("tunnel", fmt.Sprintf("%016x", order.GetDialId()), "cluster", t.GetCluster(), "namespace", t.GetNamespace(),
			"service", t.GetService(), "port", t.GetPort()),
		early: order.GetEarlyData(),
	}
}

// dialTarget connects d to its target (connect), counts the dial, and logs
// why it failed. The error says what the broker is to be told.
func (a *Agent) dialTarget(ctx context.Context, d *dialed, order *tunnelv1.DialOrder) *dialError {
	conn, err := a.connect(ctx, order)
	if err != nil {
		dials.WithLabelValues(err.code.String()).Inc()
		d.log.Info("dial failed", "code", err.code.String(), "error", err.detail)
		return err
	}
	dials.WithLabelValues(codes.OK.String()).Inc()
	d.target = conn
	return nil
}

// redacted is a failure's message as the broker gets it: its callers see
// no more of it, and nothing of the addresses behind the agent.
func redacted(message string) string { return redact.Text(message, maxFailureMessage) }

// dialed is a dial whose target accepted: what its Tunnel stream needs to
// carry it.
type dialed struct {
	id     uint64
	target *net.TCPConn
	early  []byte
	log    *slog.Logger
	// report fails the dial; earlySent says that the early data, if any,
	// may have reached the target.
	report func(code codes.Code, message string, earlySent bool)
}

// openStream carries a dial on a Tunnel stream of its own: it opens the
// stream and returns the rest of the tunnel's life, as open does. stall
// bounds each write to the target (pipe).
func openStream(ctx context.Context, client tunnelv1.AgentServiceClient, d *dialed, stall time.Duration) (run func()) {
	ctx, cancel := context.WithCancel(ctx)
	stream, err := client.Tunnel(ctx, wire.FrameCallOption())
	if err == nil {
		err = stream.Send(&tunnelv1.TunnelRequest{Frame: &tunnelv1.TunnelRequest_Open{Open: &tunnelv1.TunnelOpen{DialId: d.id}}})
	}
	if err != nil {
		cancel()
		d.target.Close()
		d.log.Info("could not open tunnel", "error", err)
		d.report(codes.Unavailable, "the agent could not open a tunnel to the broker", false)
		return nil
	}
	d.log.Debug("tunnel open", "target", d.target.RemoteAddr().String())
	return func() {
		defer d.target.Close()
		defer cancel()
		tunnelsOpen.Inc()
		defer tunnelsOpen.Dec()
		tunnelsOpened.Inc()
		if err := pipe(d.target, stream, d.early, cancel, stall); err != nil {
			d.log.Info("tunnel ended", "error", err)
			// A stream cancelled right after open (a target that resets at
			// once) may end before the broker read the open, and the dial
			// would wait there for its timeout. Fail it; the broker ignores
			// a failure for a dial it already claimed.
			d.report(codes.Unavailable, "the tunnel failed as it opened: "+reason(err), true)
		}
	}
}

// dialError is why the agent could not connect: a code and message for the
// broker and the caller, and the detail for the agent's log.
type dialError struct {
	code    codes.Code
	message string
	detail  error
}

// connect dials the addresses the resolver returns, in order, until one
// accepts. It dials nothing else.
func (a *Agent) connect(ctx context.Context, order *tunnelv1.DialOrder) (*net.TCPConn, *dialError) {
	t := order.GetTarget()
	if err := t.Validate(); err != nil {
		return nil, &dialError{codes.InvalidArgument, err.Error(), err}
	}
	svc := fmt.Sprintf("Service %s/%s port %d", t.GetNamespace(), t.GetService(), t.GetPort())
	if t.GetIp() != "" {
		svc = fmt.Sprintf("the Service of the address dialled, port %d", t.GetPort())
	}
	timeout := time.Duration(order.GetTimeoutMs()) * time.Millisecond
	if timeout <= 0 {
		timeout = defaultConnectTimeout
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	addrs, err := a.Resolver.Resolve(ctx, t)
	if err != nil {
		// The resolver speaks of Services and namespaces; what else it
		// says (a refused endpoint's address) is redacted by report.
		st := status.Convert(err)
		return nil, &dialError{st.Code(), st.Message(), err}
	}
	if len(addrs) == 0 {
		msg := svc + " has no endpoints"
		return nil, &dialError{codes.Unavailable, msg, errors.New(msg)}
	}
	var errs []error
	var d net.Dialer
	for _, addr := range addrs {
		c, err := d.DialContext(ctx, "tcp", addr)
		if err == nil {
			return c.(*net.TCPConn), nil
		}
		errs = append(errs, err)
		if ctx.Err() != nil {
			break
		}
	}
	detail := errors.Join(errs...)
	// The poller's deadline for a connect is ctx's, and may fire before
	// ctx's own timer does: an i/o timeout is the same timeout.
	if ctx.Err() != nil || errors.Is(detail, os.ErrDeadlineExceeded) {
		return nil, &dialError{codes.DeadlineExceeded, fmt.Sprintf("connecting to %s timed out after %v", svc, timeout), detail}
	}
	var reasons []string
	for _, err := range errs {
		if r := reason(err); !slices.Contains(reasons, r) {
			reasons = append(reasons, r)
		}
	}
	if len(addrs) > 1 {
		svc = fmt.Sprintf("%s (%d endpoints)", svc, len(addrs))
	}
	return nil, &dialError{codes.Unavailable, fmt.Sprintf("connecting to %s: %s", svc, strings.Join(reasons, ", ")), detail}
}

// reason says in words why a connection failed, without the addresses
// that Go's errors name.
func reason(err error) string {
	var errno syscall.Errno
	var dns *net.DNSError
	switch {
	case errors.As(err, &errno):
		return errno.Error() // "connection refused", "no route to host"
	case errors.As(err, &dns) && dns.IsNotFound:
		return "no such host"
	case errors.As(err, &dns):
		return "the name did not resolve"
	case errors.Is(err, os.ErrDeadlineExceeded), errors.Is(err, context.DeadlineExceeded):
		return "timed out"
	case errors.Is(err, context.Canceled):
		return "cancelled"
	case errors.Is(err, io.EOF):
		return "the target closed the connection"
	}
	if st, ok := status.FromError(err); ok {
		return "the broker's stream ended (" + st.Code().String() + ")"
	}
	return "the connection failed"
}

// buffers hold what the agent reads from a target: one data frame each, at
// most wire.MaxFrame bytes.
var buffers = sync.Pool{New: func() any { b := make([]byte, wire.MaxFrame); return &b }}

// pipe carries bytes between the target connection and the tunnel stream,
// early data first, until both directions are closed or either fails; cancel
// aborts the stream. Each write to the target must make progress within
// stall (targetWriter).
func pipe(conn *net.TCPConn, stream tunnelv1.AgentService_TunnelClient, early []byte, cancel context.CancelFunc, stall time.Duration) error {
	// A Write blocked on a target that does not read would not see the
	// stream end: fail it once the stream's context ends, which it does
	// when the agent cancels the stream (its target failed, or the
	// grace period is over). On a clean end nothing is being written.
	stop := context.AfterFunc(stream.Context(), func() { _ = conn.SetWriteDeadline(time.Now()) })
	defer stop()
	upErr := make(chan error, 1)
	go func() { upErr <- targetToStream(conn, stream, cancel) }()
	downErr := streamToTarget(stream, targetWriter{conn, stream.Context(), stall}, early)
	if downErr != nil {
		// The stream failed: abort the target, which ends the other side.
		conn.SetLinger(0)
		conn.Close()
		cancel()
		<-upErr
		return downErr
	}
	return <-upErr
}

// DefaultStalledWriteTimeout is the broker's default --idle-timeout: by
// then a tunnel whose target takes nothing has carried nothing, and the
// broker has ended it.
const DefaultStalledWriteTimeout = 10 * time.Minute

// targetWriter is the target connection as the copier from the broker
// writes to it: every write must make progress within stall. A target
// that stops reading blocks the copier in its write, where it reads
// neither the broker's end of the stream nor anything else: gRPC cancels
// the stream's context only once the copier's next receive returns the
// broker's status, so without a bound the tunnel's goroutines and sockets
// would stay until the target read again. One deadline per write costs a
// timer update, not a goroutine.
type targetWriter struct {
	conn *net.TCPConn
	// ctx is the stream's: once it has ended, pipe's deadline of now
	// holds, and a write sets no later one.
	ctx   context.Context
	stall time.Duration
}

// bound sets the deadline of the next write.
func (w targetWriter) bound() {
	_ = w.conn.SetWriteDeadline(time.Now().Add(w.stall))
	// The stream's context ends before pipe's AfterFunc runs: if it has
	// not ended by now, that deadline comes after this one.
	if w.ctx.Err() != nil {
		_ = w.conn.SetWriteDeadline(time.Now())
	}
}

func (w targetWriter) Write(p []byte) (int, error) {
	w.bound()
	return w.conn.Write(p)
}

// writeFrame writes f's data to the target in one vectored write.
func (w targetWriter) writeFrame(f *wire.Frame) error {
	w.bound()
	_, err := f.WriteTo(w.conn)
	return err
}

// targetToStream forwards the target's bytes, then its half-close.
func targetToStream(conn *net.TCPConn, stream tunnelv1.AgentService_TunnelClient, cancel context.CancelFunc) error {
	bp := buffers.Get().(*[]byte)
	defer buffers.Put(bp)
	buf := *bp
	for {
		n, err := conn.Read(buf)
		if n > 0 {
			// Send marshals before it returns, so buf can be reused.
			if err := stream.Send(&tunnelv1.TunnelRequest{Frame: &tunnelv1.TunnelRequest_Data{Data: buf[:n]}}); err != nil {
				return err
			}
		}
		if errors.Is(err, io.EOF) {
			return stream.CloseSend()
		}
		if err != nil {
			cancel()
			return fmt.Errorf("reading from target: %w", err)
		}
	}
}

// streamToTarget forwards the caller's bytes, early data first, then its
// half-close, until the broker ends the stream. It returns nil only for a
// clean end.
func streamToTarget(stream tunnelv1.AgentService_TunnelClient, target targetWriter, early []byte) error {
	if len(early) > 0 {
		if _, err := target.Write(early); err != nil {
			return fmt.Errorf("writing early data to target: %w", err)
		}
	}
	for {
		// Data goes from gRPC's buffers to the socket in one vectored
		// write, without being decoded or copied (wire.Frame).
		var f wire.Frame
		err := stream.RecvMsg(&f)
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		if _, err := f.DataLen(); err == nil {
			err := target.writeFrame(&f)
			f.Free()
			if err != nil {
				return fmt.Errorf("writing to target: %w", err)
			}
			continue
		}
		var msg tunnelv1.TunnelResponse
		err = f.Decode(&msg)
		f.Free()
		if err != nil || msg.GetCloseWrite() == nil {
			return fmt.Errorf("protocol error: unexpected %T from broker", msg.GetFrame())
		}
		if err := target.conn.CloseWrite(); err != nil {
			return fmt.Errorf("half-closing target: %w", err)
		}
	}
}
