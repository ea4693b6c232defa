package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"slices"
	"strings"
	"syscall"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/internal/errinfo"
	"github.com/kcp-dev/tunnel-broker/internal/redact"
	"github.com/kcp-dev/tunnel-broker/internal/splice"
	"github.com/kcp-dev/tunnel-broker/internal/tracing"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// defaultConnectTimeout applies when an order carries no timeout.
const defaultConnectTimeout = 5 * time.Second

// maxFailureMessage bounds a dial_failure's message, in bytes: the broker
// shows its callers no more of it (docs/protocol.md §5).
const maxFailureMessage = 256

// open answers one dial order up to its splice: connect to the target, then
// open the tunnel's Tunnel stream to the broker; or report why not, and
// return nil. What it returns is the rest of the tunnel's life: write the
// order's early data to the target, splice, and clean up. The early data
// goes only after the open, so that a dial whose early data reached a
// target is one the broker has claimed, or one it is told not to order
// again (docs/protocol.md §3.4).
//
// What it reports may reach kcp's end users in admission errors: a short
// reason in words, without addresses. The details stay in the agent's log,
// under the tunnel id, which the broker's log and the caller's message name
// too.
func (a *Agent) open(ctx context.Context, client tunnelv1.AgentServiceClient, order *tunnelv1.DialOrder, fail func(*tunnelv1.DialFailure)) (run func()) {
	ctx, span := startOrderSpan(ctx, order)
	d := a.newDialed(order, span)
	d.report = func(code codes.Code, reason, message string, earlySent bool) {
		fail(&tunnelv1.DialFailure{DialId: d.id, Code: int32(code), Reason: reason, Message: redacted(message),
			EarlyDataSent: earlySent && len(d.early) > 0})
	}
	if err := a.dialTarget(ctx, d, order); err != nil {
		d.report(err.code, err.reason, err.message, false)
		tracing.End(span, status.Error(err.code, redacted(err.message)))
		return nil
	}
	run = openStream(ctx, client, d, a.stalledWriteTimeout())
	if run == nil {
		tracing.End(span, status.Error(codes.Unavailable, "the agent could not open a tunnel to the broker"))
		return nil
	}
	tracing.End(span, nil)
	return run
}

// newDialed is the dial of order before it connects, with a log that
// names its tunnel id, target and trace.
func (a *Agent) newDialed(order *tunnelv1.DialOrder, span trace.Span) *dialed {
	t := order.GetTarget()
	return &dialed{
		id: order.GetDialId(),
		log: a.Log.With(append([]any{"tunnel", tunnelID(order.GetDialId()), "cluster", t.GetCluster(), "namespace", t.GetNamespace(),
			"service", t.GetService(), "port", t.GetPort()}, tracing.LogAttrs(span)...)...),
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

// tunnelID is the name of the tunnel of a dial, as the broker's log, its
// listing and the caller's errors give it.
func tunnelID(dialID uint64) string { return fmt.Sprintf("%016x", dialID) }

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
	report func(code codes.Code, reason, message string, earlySent bool)
}

// openStream carries a dial on a Tunnel stream of its own: it opens the
// stream and returns the rest of the tunnel's life, as open does. stall
// bounds each write to the target (carry).
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
		d.report(codes.Unavailable, "", "the agent could not open a tunnel to the broker", false)
		return nil
	}
	d.log.Debug("tunnel open", "target", d.target.RemoteAddr().String())
	return func() {
		tunnelsOpen.Inc()
		defer tunnelsOpen.Dec()
		tunnelsOpened.Inc()
		if failed := carry(ctx, d, stream, cancel, stall); failed != nil {
			d.log.Info("tunnel ended", "failed", side(failed.By), "error", failed.Err)
			// A stream cancelled right after open (a target that resets at
			// once) may end before the broker read the open, and the dial
			// would wait there for its timeout. Fail it; the broker ignores
			// a failure for a dial it already claimed.
			d.report(codes.Unavailable, "", "the tunnel failed as it opened: "+errinfo.ConnectFailure(failed.Err), true)
		}
	}
}

// Sides of an agent's splice.
const (
	targetSide = splice.A
	brokerSide = splice.B
)

// side names a side of the agent's splice in its log.
func side(s splice.Side) string {
	if s == targetSide {
		return "target"
	}
	return "broker"
}

// carry writes the order's early data to the target, then splices the
// target's connection (A) with the Tunnel stream (B), opened with ctx and
// cancelled by cancel, until the tunnel ends: the same legs and splice as
// the broker's. Each write to the target must make progress within stall:
// a target that stops reading would otherwise block the copier writing to
// it, where it reads neither the broker's end of the stream nor anything
// else, until the target read again. It returns the failure the tunnel
// ended at, nil for a clean end.
func carry(ctx context.Context, d *dialed, stream tunnelv1.AgentService_TunnelClient, cancel context.CancelFunc, stall time.Duration) *splice.Failure {
	target := splice.NewConnLeg(d.target, stall)
	broker := splice.ClientStream(ctx, stream, cancel)
	if len(d.early) > 0 {
		early := wire.NewDataFrame(d.early)
		if err := target.Send(&early); err != nil {
			failed := &splice.Failure{By: targetSide, Err: fmt.Errorf("writing early data to target: %w", err)}
			target.End(failed)
			broker.End(failed)
			return failed
		}
	}
	// Inline: this goroutine copies the broker's direction, so that an
	// idle tunnel holds two goroutines, not three.
	failed, _, _ := splice.Splice(target, broker, splice.Config{Inline: true})
	return failed
}

// dialError is why the agent could not connect: a code, reason (package
// errinfo's, or none) and message for the broker and the caller, and the
// detail for the agent's log.
type dialError struct {
	code    codes.Code
	message string
	detail  error
	reason  string
}

// connect dials the addresses the resolver returns, in order, until one
// accepts. It dials nothing else.
func (a *Agent) connect(ctx context.Context, order *tunnelv1.DialOrder) (*net.TCPConn, *dialError) {
	t := order.GetTarget()
	if err := t.Validate(); err != nil {
		return nil, &dialError{code: codes.InvalidArgument, message: err.Error(), detail: err}
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
	addrs, err := a.lookup(ctx, t)
	if err != nil {
		// The resolver speaks of Services and namespaces; what else it
		// says (a refused endpoint's address) is redacted by report.
		st := status.Convert(err)
		return nil, &dialError{code: st.Code(), message: st.Message(), detail: err, reason: errinfo.Of(err)}
	}
	if len(addrs) == 0 {
		msg := svc + " has no endpoints"
		return nil, &dialError{code: codes.Unavailable, message: msg, detail: errors.New(msg), reason: errinfo.NoEndpoints}
	}
	conn, errs := dialEndpoints(ctx, addrs)
	if conn != nil {
		return conn, nil
	}
	detail := errors.Join(errs...)
	// The poller's deadline for a connect is ctx's, and may fire before
	// ctx's own timer does: an i/o timeout is the same timeout.
	if ctx.Err() != nil || errors.Is(detail, os.ErrDeadlineExceeded) {
		return nil, &dialError{code: codes.DeadlineExceeded, message: fmt.Sprintf("connecting to %s timed out after %v", svc, timeout), detail: detail}
	}
	var reasons []string
	refused := true // by every endpoint tried
	for _, err := range errs {
		if r := errinfo.ConnectFailure(err); !slices.Contains(reasons, r) {
			reasons = append(reasons, r)
		}
		refused = refused && errors.Is(err, syscall.ECONNREFUSED)
	}
	if len(addrs) > 1 {
		svc = fmt.Sprintf("%s (%d endpoints)", svc, len(addrs))
	}
	why := errinfo.TargetUnreachable
	if refused {
		why = errinfo.TargetRefused
	}
	return nil, &dialError{code: codes.Unavailable, message: fmt.Sprintf("connecting to %s: %s", svc, strings.Join(reasons, ", ")), detail: detail, reason: why}
}

// lookup is the resolver's answer for t, in a span of its own.
func (a *Agent) lookup(ctx context.Context, t *tunnelv1.Target) ([]string, error) {
	ctx, span := tracing.Tracer().Start(ctx, spanLookup)
	addrs, err := a.Resolver.Resolve(ctx, t)
	tracing.End(span, err, tracing.Endpoints.Int(len(addrs)))
	return addrs, err
}

// dialEndpoints connects to the first of addrs that accepts, in order, in
// a span of its own; or returns why each it tried did not.
func dialEndpoints(ctx context.Context, addrs []string) (*net.TCPConn, []error) {
	ctx, span := tracing.Tracer().Start(ctx, spanConnect, trace.WithSpanKind(trace.SpanKindClient))
	var errs []error
	var d net.Dialer
	for _, addr := range addrs {
		c, err := d.DialContext(ctx, "tcp", addr)
		if err == nil {
			span.SetAttributes(attribute.Int("tunnel.endpoints_tried", len(errs)+1))
			tracing.End(span, nil)
			return c.(*net.TCPConn), nil
		}
		errs = append(errs, err)
		if ctx.Err() != nil {
			break
		}
	}
	// The span says why in words; the addresses stay in the log.
	span.SetAttributes(attribute.Int("tunnel.endpoints_tried", len(errs)))
	tracing.End(span, status.Error(codes.Unavailable, errinfo.ConnectFailure(errors.Join(errs...))))
	return nil, errs
}

// DefaultStalledWriteTimeout is the broker's default --idle-timeout: by
// then a tunnel whose target takes nothing has carried nothing, and the
// broker has ended it.
const DefaultStalledWriteTimeout = 10 * time.Minute
