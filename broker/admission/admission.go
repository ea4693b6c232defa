// Package admission is the broker's one front door for callers: the Dial
// RPC and the CONNECT front end admit their tunnels through it alike. It
// holds what both must agree on: who the caller is, what the policy lets
// it dial, one quota of tunnels per caller whichever front end it uses,
// the bound on early data, the drain, the dial metrics, the audit line of
// every tunnel (audit.go) and the listing of open tunnels
// (tunnel.Config.Table). A front end only decodes its own protocol: a
// Dial stream's messages, or a CONNECT request.
//
// A caller's tunnel goes in three steps: Hold counts it against its caller
// from the moment its stream or connection asks for one, before it names a
// target, so that dials that have not named one yet count too; Ticket.Dial
// checks and dials the target; Ticket.Splice carries the tunnel until it
// ends and audits it.
package admission

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/broker/authz"
	"github.com/kcp-dev/tunnel-broker/broker/internal/quota"
	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/broker/registry"
	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
	"github.com/kcp-dev/tunnel-broker/internal/errinfo"
	"github.com/kcp-dev/tunnel-broker/internal/tracing"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// Defaults of Config.
const (
	// DefaultTimeout bounds a dial when the caller sets no shorter
	// deadline. It sits below the admission webhook default of 10s, so a
	// dial that cannot succeed fails with its own status, not the
	// webhook's timeout.
	DefaultTimeout = 5 * time.Second
	// DefaultMaxTunnelsPerCaller bounds the tunnels of one caller, Dial's
	// and CONNECT's together: kcp holds one per webhook call in flight.
	DefaultMaxTunnelsPerCaller = 20000
	// DefaultMaxEarlyDataPerCaller and DefaultMaxEarlyData bound the early
	// data that pending dials hold, per caller and all callers together:
	// 1024 dials with the most early data there may be (16 KiB) per caller.
	// kcp's early data is a TLS ClientHello, under 2 KiB.
	DefaultMaxEarlyDataPerCaller = 16 << 20
	DefaultMaxEarlyData          = 64 << 20
)

// Config is what the front door needs. As in every Config of the broker, a
// zero value means the default, and a negative limit means none.
type Config struct {
	Registry *registry.Registry
	Policy   *policy.Policy
	// Timeout bounds a dial, from its target to its agent's open; zero or
	// negative: DefaultTimeout.
	Timeout time.Duration
	// MaxTunnelsPerCaller bounds the tunnels one caller holds, its dials
	// included from their start, whichever front end they came through;
	// zero: DefaultMaxTunnelsPerCaller.
	MaxTunnelsPerCaller int64
	// MaxEarlyDataPerCaller and MaxEarlyData bound the bytes of early data
	// that pending dials hold, of one caller and of all together; zero:
	// DefaultMaxEarlyDataPerCaller and DefaultMaxEarlyData.
	MaxEarlyDataPerCaller, MaxEarlyData int64
	// Tunnels is what ends tunnels besides their peers (the idle limit,
	// the broker's stop), and the table that lists them.
	Tunnels tunnel.Config
	// Draining ends when the broker stops taking dials; nil: never.
	Draining context.Context
	// BrokerID names this replica in audit lines.
	BrokerID string
	// Log takes every failure and every tunnel's audit line.
	Log *slog.Logger
}

// Admission is the front door of one broker replica.
type Admission struct {
	cfg     Config
	callers quota.Quota // tunnels and dials, per caller
	early   quota.Quota // bytes of early data in pending dials
	active  atomic.Int64
	dialing atomic.Int64
}

// New is a front door with cfg, its defaults resolved.
func New(cfg Config) *Admission {
	cfg.Timeout = cmp.Or(max(cfg.Timeout, 0), DefaultTimeout)
	if cfg.Draining == nil {
		cfg.Draining = context.Background()
	}
	cfg.Log = cmp.Or(cfg.Log, slog.Default())
	return &Admission{
		cfg:     cfg,
		callers: quota.Quota{PerID: cmp.Or(cfg.MaxTunnelsPerCaller, DefaultMaxTunnelsPerCaller)},
		early:   quota.Quota{PerID: cmp.Or(cfg.MaxEarlyDataPerCaller, DefaultMaxEarlyDataPerCaller), Total: cmp.Or(cfg.MaxEarlyData, DefaultMaxEarlyData)},
	}
}

// Active is the number of tunnels spliced right now, all front ends'.
func (a *Admission) Active() int64 { return a.active.Load() }

// Dialing is the number of dials in progress: from Ticket.Dial's call to
// its return, so a dial that began before the drain is counted until it
// is answered, and one that begins after is refused.
func (a *Admission) Dialing() int64 { return a.dialing.Load() }

// Held is the number of tunnels and dials that count against the caller
// id, whichever front end they came through.
func (a *Admission) Held(id spiffeid.ID) int64 { return a.callers.Held(id) }

// Caller is who asks for a tunnel, and through which front end.
type Caller struct {
	// ID is the caller's SPIFFE ID; zero for a Unix socket's caller, whom
	// the socket's permissions admitted (all such callers share a quota).
	ID spiffeid.ID
	// Frontend names the front end, in metrics and logs: "Dial" (the
	// RPC) or "CONNECT".
	Frontend string
	// Authorized says that the front end has asked the policy already: a
	// CONNECT's cluster is the one its caller's egress rule names, or the
	// one its Unix socket serves. Otherwise the policy must let ID dial
	// the target's cluster.
	Authorized bool
}

func (c Caller) String() string {
	if c.ID.IsZero() {
		return "unix socket"
	}
	return c.ID.String()
}

// Ticket is one caller's claim to a tunnel, from Hold until the tunnel has
// ended (Splice) or the front end gives up (Release).
type Ticket struct {
	a       *Admission
	caller  Caller
	release func()
	spliced bool
	log     *slog.Logger
	span    trace.Span // the tunnel's (trace.go)
	err     error      // why the dial failed, for the span
}

// Hold counts one more tunnel against caller, unless it holds its limit:
// ResourceExhausted. The front end must Splice a tunnel on the ticket or
// Release it. The tunnel's span starts here, a child of the span context
// the front end found in ctx (the caller's), if any.
func (a *Admission) Hold(ctx context.Context, caller Caller) (*Ticket, error) {
	_, span := startTunnelSpan(ctx, caller)
	release, over := a.callers.Take(caller.ID)
	if over == quota.Under {
		return &Ticket{a: a, caller: caller, release: release, log: a.cfg.Log, span: span}, nil
	}
	metrics.LimitsHit.WithLabelValues("tunnels_per_caller").Inc()
	metrics.Dials.WithLabelValues(codes.ResourceExhausted.String()).Inc()
	a.cfg.Log.Warn("dial refused: caller at its tunnel limit", append([]any{"caller", caller.String(), "frontend", caller.Frontend, "limit", a.callers.PerID},
		tracing.LogAttrs(span)...)...)
	err := status.Errorf(codes.ResourceExhausted, "%s already holds %d tunnels, the most a caller may", caller, a.callers.PerID)
	tracing.End(span, err)
	return nil, err
}

// Release gives the ticket back unless a tunnel was spliced on it, whose
// end gives it back. Front ends defer it.
func (tk *Ticket) Release() {
	if !tk.spliced {
		tk.release()
		tracing.End(tk.span, tk.err)
	}
}

// TraceID is the trace of the tunnel's span, "" when it has none (no
// trace from the caller and tracing off).
func (tk *Ticket) TraceID() string {
	if sc := tk.span.SpanContext(); sc.IsValid() {
		return sc.TraceID().String()
	}
	return ""
}

// Dial checks a dial's target and early data (check), and orders an agent
// to connect to it within ctx and the dial timeout. The tunnel it returns
// must be spliced (Splice) or ended (tunnel.End).
func (tk *Ticket) Dial(ctx context.Context, target *tunnelv1.Target, earlyData []byte) (t *tunnel.Tunnel, err error) {
	tk.a.dialing.Add(1)
	defer tk.a.dialing.Add(-1)
	defer func() { tk.err = err }()
	ctx = trace.ContextWithSpan(ctx, tk.span)
	releaseEarly, err := tk.admit(ctx, target, len(earlyData))
	if err != nil {
		return nil, err
	}
	defer releaseEarly()
	tk.span.SetAttributes(tracing.TargetAttrs(target)...)
	log := tk.a.cfg.Log.With(append([]any{"cluster", target.GetCluster(), "namespace", target.GetNamespace(), "service", target.GetService(),
		"ip", target.GetIp(), "port", target.GetPort(), "caller", tk.caller.String(), "frontend", tk.caller.Frontend},
		tracing.LogAttrs(tk.span)...)...)
	ctx, cancel := context.WithTimeout(ctx, tk.a.cfg.Timeout)
	defer cancel()
	ctx, span := tracing.Tracer().Start(ctx, spanDial)
	t, took, failure, err := tk.a.dial(ctx, target, earlyData)
	if err != nil {
		tracing.End(span, err)
		log.Info("dial failed", failure...)
		return nil, err
	}
	tracing.End(span, nil, tracing.TunnelID.String(t.ID), tracing.Agent.String(t.Agent.String()))
	tk.span.SetAttributes(tracing.TunnelID.String(t.ID), tracing.Agent.String(t.Agent.String()))
	t.Caller, t.CallerID, t.Established, t.TraceID = tk.caller.String(), tk.caller.ID, time.Now(), tk.TraceID()
	tk.log = log.With("tunnel", t.ID, "agent", t.Agent.String())
	tk.log.Debug("tunnel established", "took", took)
	return t, nil
}

// admit is the admission span: the dial's checks (check), and its early
// data held against its bounds (HoldEarlyData).
func (tk *Ticket) admit(ctx context.Context, target *tunnelv1.Target, earlyData int) (releaseEarly func(), err error) {
	_, span := tracing.Tracer().Start(ctx, spanAdmission)
	defer func() { tracing.End(span, err) }()
	if err := tk.check(target, earlyData); err != nil {
		return nil, err
	}
	return tk.HoldEarlyData(earlyData)
}

// dial is tunnel.Dial, counted in the dial metrics, with the limit that
// refused it if one did; it returns how long it took and, for a failure,
// what to log it with.
func (a *Admission) dial(ctx context.Context, target *tunnelv1.Target, earlyData []byte) (t *tunnel.Tunnel, took time.Duration, logAttrs []any, err error) {
	start := time.Now()
	t, err = tunnel.Dial(ctx, a.cfg.Registry, target, earlyData)
	took = time.Since(start)
	code := status.Code(err)
	metrics.Dials.WithLabelValues(code.String()).Inc()
	metrics.DialSeconds.WithLabelValues(code.String()).Observe(took.Seconds())
	if err == nil {
		return t, took, nil, nil
	}
	if limit, ok := errors.AsType[*registry.LimitError](err); ok {
		metrics.LimitsHit.WithLabelValues(limit.Limit).Inc()
	}
	if failed, ok := errors.AsType[*registry.DialError](err); ok {
		logAttrs = failed.LogAttrs()
	}
	return nil, took, append(logAttrs, "code", code.String(), "error", status.Convert(err).Message(), "took", took), err
}

// check checks a dial: a valid target that the caller may dial, with at
// most wire.MaxEarlyData bytes of early data, while the broker takes dials.
// A refusal by the policy is counted and logged.
func (tk *Ticket) check(target *tunnelv1.Target, earlyData int) error {
	if target == nil {
		return status.Error(codes.InvalidArgument, "the first message of a dial must name a target")
	}
	if err := target.Validate(); err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	if earlyData > wire.MaxEarlyData {
		return status.Errorf(codes.InvalidArgument, "a dial's early data may be at most %d bytes, not %d", wire.MaxEarlyData, earlyData)
	}
	if !tk.caller.Authorized {
		if err := tk.a.cfg.Policy.MayDial(tk.caller.ID, target.GetCluster()); err != nil {
			return authz.Deny(tk.a.cfg.Log, tk.caller.String(), authz.AskedDial, err.Error(), "frontend", tk.caller.Frontend, "cluster", target.GetCluster())
		}
	}
	if tk.a.cfg.Draining.Err() != nil {
		return errDraining
	}
	return nil
}

// errDraining refuses a dial that reached a replica after its drain began.
var errDraining = errinfo.Error(codes.Unavailable, errinfo.ReplicaDraining, "this broker replica is shutting down: dial another")

// ElsewhereMayServe reports whether err refused a dial that another broker
// replica may serve, before anything was ordered: this replica drains, or
// no agent of the dial's cluster has registered with it. A caller may send
// the same dial to another replica (docs/protocol.md, "Retrying a dial on
// another replica"); for any other failure it must not, since the target
// may have seen the dial.
func ElsewhereMayServe(err error) bool {
	_, noAgent := errors.AsType[*registry.NoAgentError](err)
	return noAgent || errors.Is(err, errDraining)
}

// HoldEarlyData counts n bytes a dial's caller sent before established
// against it while the dial is pending: its early data, and what a front
// end reads of it meanwhile (the Dial stream's data frames). It refuses
// them if they put the caller or all callers past their bound; release
// gives them back. Once the dial is answered the bytes are the target's.
func (tk *Ticket) HoldEarlyData(n int) (release func(), err error) {
	if n == 0 {
		return func() {}, nil
	}
	a, caller := tk.a, tk.caller
	release, over := a.early.TakeN(caller.ID, int64(n))
	if over == quota.Under {
		return release, nil
	}
	limit, holder, held, bound := "early_data", "the broker's pending dials", a.early.TotalHeld(), a.early.Total
	if over == quota.OverPerID {
		limit, holder, held, bound = "early_data_per_caller", "the pending dials of "+caller.String(), a.early.Held(caller.ID), a.early.PerID
	}
	msg := fmt.Sprintf("%s hold %d bytes of early data, and %d more would pass its %d", holder, held, n, bound)
	metrics.LimitsHit.WithLabelValues(limit).Inc()
	metrics.Dials.WithLabelValues(codes.ResourceExhausted.String()).Inc()
	a.cfg.Log.Warn("dial refused: early data over its bound", "caller", caller.String(), "limit", limit)
	return nil, status.Error(codes.ResourceExhausted, msg+": dial without early data, or once fewer dials are pending")
}

// Splice carries the established tunnel t with the caller's leg until it
// ends (tunnel.Splice), lists it meanwhile, audits it, and returns the
// status the caller's leg ended with. The tunnel stops counting against
// its caller once nothing of it runs any more.
func (tk *Ticket) Splice(t *tunnel.Tunnel, caller tunnel.Leg, kind string) error {
	a := tk.a
	tk.spliced = true
	a.active.Add(1)
	metrics.Tunnels.Inc()
	metrics.TunnelsOpened.WithLabelValues(kind).Inc()
	released := func() {
		tk.release()
		a.active.Add(-1)
		metrics.Tunnels.Dec()
	}
	callerStatus, agentStatus := t.Splice(caller, a.cfg.Tunnels, released)
	a.audit(t, tk.caller.Frontend, callerStatus)
	up, down := t.Bytes()
	tracing.End(tk.span, callerStatus, tracing.AgentCode.Int64(int64(status.Code(agentStatus))),
		tracing.BytesUp.Int64(up), tracing.BytesDown.Int64(down))
	if agentStatus != nil {
		tk.log.Info("tunnel ended", "caller_code", status.Code(callerStatus).String(),
			"agent_code", status.Code(agentStatus).String(), "error", status.Convert(agentStatus).Message())
	} else {
		tk.log.Debug("tunnel closed")
	}
	return callerStatus
}
