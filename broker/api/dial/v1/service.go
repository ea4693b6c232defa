// Package dial serves kcp.tunnel.v1.DialService: a caller names a Service in
// a logical cluster and gets a byte stream to it through an agent.
package dial

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/broker/internal/quota"
	"github.com/kcp-dev/tunnel-broker/broker/internal/receive"
	"github.com/kcp-dev/tunnel-broker/broker/internal/spares"
	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/broker/registry"
	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
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
	// DefaultMaxTunnelsPerCaller bounds the tunnels of one caller: kcp holds
	// one per webhook call in flight.
	DefaultMaxTunnelsPerCaller = 20000
	// DefaultMaxEarlyDataPerCaller and DefaultMaxEarlyData bound the early
	// data that pending dials hold, per caller and all callers together:
	// 1024 dials with the most early data there may be (16 KiB) per caller.
	// kcp's early data is a TLS ClientHello, under 2 KiB.
	DefaultMaxEarlyDataPerCaller = 16 << 20
	DefaultMaxEarlyData          = 64 << 20
)

// Config is what the dial service needs. As in every Config of the broker,
// a zero value means the default, and a negative limit means none.
type Config struct {
	Registry *registry.Registry
	Policy   *policy.Policy
	// Timeout bounds a dial, from its target to its agent's open; zero or
	// negative: DefaultTimeout.
	Timeout time.Duration
	// MaxTunnelsPerCaller bounds the tunnels one SPIFFE ID holds, its dials
	// included from their stream's start; zero: DefaultMaxTunnelsPerCaller.
	MaxTunnelsPerCaller int64
	// MaxEarlyDataPerCaller and MaxEarlyData bound the bytes of early data
	// that pending dials hold, of one SPIFFE ID and of all together; zero:
	// DefaultMaxEarlyDataPerCaller and DefaultMaxEarlyData.
	MaxEarlyDataPerCaller, MaxEarlyData int64
	// MaxSparesPerPeer and MaxSpares bound the spare dial connections
	// (dialconn.go) of one SPIFFE ID and of all together; zero:
	// DefaultMaxSparesPerPeer and DefaultMaxSpares.
	MaxSparesPerPeer, MaxSpares int64
	// Tunnels is what ends tunnels besides their peers: the idle limit and
	// the broker's stop.
	Tunnels tunnel.Config
	// Draining ends when the broker stops taking dials; nil: never.
	Draining context.Context
	// BrokerID names this replica in audit lines.
	BrokerID string
	// Log takes every failure and every tunnel's audit line (audit.go).
	Log *slog.Logger
}

// Service implements DialService.
type Service struct {
	tunnelv1.UnimplementedDialServiceServer

	cfg     Config
	callers quota.Quota  // tunnels and dials, per caller SPIFFE ID
	early   quota.Quota  // bytes of early data in pending dials
	spares  spares.Bound // dial connections waiting for their dial
	active  atomic.Int64
}

// New is a dial service with cfg, its defaults resolved.
func New(cfg Config) *Service {
	cfg.Timeout = cmp.Or(max(cfg.Timeout, 0), DefaultTimeout)
	if cfg.Draining == nil {
		cfg.Draining = context.Background()
	}
	cfg.Log = cmp.Or(cfg.Log, slog.Default())
	return &Service{
		cfg:     cfg,
		callers: quota.Quota{PerID: cmp.Or(cfg.MaxTunnelsPerCaller, DefaultMaxTunnelsPerCaller)},
		early:   quota.Quota{PerID: cmp.Or(cfg.MaxEarlyDataPerCaller, DefaultMaxEarlyDataPerCaller), Total: cmp.Or(cfg.MaxEarlyData, DefaultMaxEarlyData)},
		spares: spares.Bound{Quota: quota.Quota{PerID: cmp.Or(cfg.MaxSparesPerPeer, DefaultMaxSparesPerPeer), Total: cmp.Or(cfg.MaxSpares, DefaultMaxSpares)},
			Kind: "dial", Gauge: metrics.SpareDialConnections},
	}
}

// RegisterService registers s on srv.
func RegisterService(srv grpc.ServiceRegistrar, s *Service) {
	tunnelv1.RegisterDialServiceServer(srv, s)
}

// Active is the number of tunnels spliced right now.
func (s *Service) Active() int64 { return s.active.Load() }

// Dial implements DialService.Dial: the caller's target, its agent's tunnel,
// and the splice until the tunnel's end. The work before the splice is done
// in calls of their own, so that this frame, which stays on the handler's
// stack for the tunnel's life, stays small (docs/perf-history.md, idle
// tunnels' stacks).
func (s *Service) Dial(stream tunnelv1.DialService_DialServer) error {
	caller, _ := identity.PeerID(stream.Context())
	// A dial counts against its caller's tunnels from its stream's start,
	// so that dials that have not named their target yet count too.
	release, err := s.holdTunnel(caller)
	if err != nil {
		return err
	}
	defer release()
	t, log, err := s.establish(stream, caller)
	if err != nil {
		return err
	}
	return s.splice(stream, t, release, log)
}

// establish receives the caller's target, has its agent connect to it, and
// tells the caller that the tunnel is established.
func (s *Service) establish(stream tunnelv1.DialService_DialServer, caller spiffeid.ID) (*tunnel.Tunnel, *slog.Logger, error) {
	first, err := s.receiveTarget(stream, caller)
	if err != nil {
		return nil, nil, err
	}
	t, log, err := s.open(stream.Context(), first, caller)
	if err != nil {
		return nil, nil, err
	}
	established := &tunnelv1.DialResponse{Frame: &tunnelv1.DialResponse_Established{Established: &tunnelv1.Established{TunnelId: t.ID}}}
	if err := stream.Send(established); err != nil {
		t.End(status.Error(codes.Canceled, "caller went away"))
		return nil, nil, err
	}
	return t, log, nil
}

// open dials the target of a dial's first message, checked by checkDial,
// and makes the tunnel caller's: a Dial stream's and a dial connection's
// tunnels are opened alike. The logger names the dial, and the tunnel once
// there is one.
func (s *Service) open(ctx context.Context, first *tunnelv1.DialRequest, caller spiffeid.ID) (*tunnel.Tunnel, *slog.Logger, error) {
	target := first.GetTarget()
	log := s.cfg.Log.With("cluster", target.GetCluster(), "namespace", target.GetNamespace(),
		"service", target.GetService(), "port", target.GetPort(), "caller", caller.String())
	releaseEarly, err := s.holdEarlyData(caller, len(first.GetEarlyData()))
	if err != nil {
		return nil, nil, err
	}
	t, took, err := s.dial(ctx, target, first.GetEarlyData(), log)
	releaseEarly()
	if err != nil {
		return nil, nil, err
	}
	t.Caller, t.Established = caller, time.Now()
	log = log.With("tunnel", t.ID, "agent", t.Agent.String())
	log.Debug("tunnel established", "took", took)
	return t, log, nil
}

// holdTunnel counts one more tunnel against caller, unless it holds its
// limit; release gives it back.
func (s *Service) holdTunnel(caller spiffeid.ID) (release func(), err error) {
	release, over := s.callers.Take(caller)
	if over == quota.Under {
		return release, nil
	}
	metrics.LimitsHit.WithLabelValues("tunnels_per_caller").Inc()
	s.cfg.Log.Warn("dial refused: caller at its tunnel limit", "caller", caller.String(), "limit", s.callers.PerID)
	metrics.Dials.WithLabelValues(codes.ResourceExhausted.String()).Inc()
	return nil, status.Errorf(codes.ResourceExhausted, "%s already holds %d tunnels, the most a caller may", caller, s.callers.PerID)
}

// holdEarlyData counts a dial's n bytes of early data against its caller
// while the dial is pending, unless that puts the caller or all callers
// past their bound; release gives them back. Once the dial is answered the
// early data is the target's, or the splice's first frame.
func (s *Service) holdEarlyData(caller spiffeid.ID, n int) (release func(), err error) {
	if n == 0 {
		return func() {}, nil
	}
	release, over := s.early.TakeN(caller, int64(n))
	if over == quota.Under {
		return release, nil
	}
	limit, holder, held, bound := "early_data", "the broker's pending dials", s.early.TotalHeld(), s.early.Total
	if over == quota.OverPerID {
		limit, holder, held, bound = "early_data_per_caller", "the pending dials of "+caller.String(), s.early.Held(caller), s.early.PerID
	}
	msg := fmt.Sprintf("%s hold %d bytes of early data, and %d more would pass its %d", holder, held, n, bound)
	metrics.LimitsHit.WithLabelValues(limit).Inc()
	metrics.Dials.WithLabelValues(codes.ResourceExhausted.String()).Inc()
	s.cfg.Log.Warn("dial refused: early data over its bound", "caller", caller.String(), "limit", limit)
	return nil, status.Error(codes.ResourceExhausted, msg+": dial without early data, or once fewer dials are pending")
}

// receiveTarget receives the first message of a Dial stream and checks it
// (checkDial).
func (s *Service) receiveTarget(stream tunnelv1.DialService_DialServer, caller spiffeid.ID) (*tunnelv1.DialRequest, error) {
	first, err := receive.First[tunnelv1.DialRequest](stream, "stream closed before naming a target")
	if err != nil {
		return nil, err
	}
	if err := s.checkDial(first, caller, "Dial"); err != nil {
		return nil, err
	}
	return first, nil
}

// checkDial checks the first message of a dial, on a stream or a dial
// connection: it must name a valid target that the caller may dial, with
// at most wire.MaxEarlyData bytes of early data, while the broker takes
// dials. A refusal by the policy is counted and logged under method.
func (s *Service) checkDial(first *tunnelv1.DialRequest, caller spiffeid.ID, method string) error {
	target := first.GetTarget()
	if target == nil {
		return status.Error(codes.InvalidArgument, "the first message of a dial must name a target")
	}
	if err := target.Validate(); err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	if n := len(first.GetEarlyData()); n > wire.MaxEarlyData {
		return status.Errorf(codes.InvalidArgument, "a dial's early data may be at most %d bytes, not %d", wire.MaxEarlyData, n)
	}
	if err := s.cfg.Policy.MayDial(caller, target.GetCluster()); err != nil {
		metrics.Denied.WithLabelValues(method).Inc()
		s.cfg.Log.Warn("permission denied", "peer", caller.String(), "method", method, "cluster", target.GetCluster())
		return status.Error(codes.PermissionDenied, err.Error())
	}
	if s.cfg.Draining.Err() != nil {
		return status.Error(codes.Unavailable, "this broker replica is shutting down: dial another")
	}
	return nil
}

// dial orders an agent to connect to target and waits for its tunnel, within
// the dial timeout; it counts the dial's outcome and logs a failure.
func (s *Service) dial(ctx context.Context, target *tunnelv1.Target, earlyData []byte, log *slog.Logger) (*tunnel.Tunnel, time.Duration, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	t, took, failure, err := tunnel.DialCounted(ctx, s.cfg.Registry, target, earlyData)
	if err != nil {
		log.Info("dial failed", failure...)
	}
	return t, took, err
}

// splice splices the established tunnel t with the caller's stream until
// the tunnel ends, and returns the caller's status.
func (s *Service) splice(stream tunnelv1.DialService_DialServer, t *tunnel.Tunnel, release func(), log *slog.Logger) error {
	metrics.TunnelsOpened.WithLabelValues("stream").Inc()
	callerStatus, agentStatus := t.Splice(stream, s.cfg.Tunnels, s.spliced(release))
	s.ended(t, callerStatus, agentStatus, log)
	return callerStatus
}

// spliced counts a tunnel that is spliced from now on, and returns what
// counts it out when it ends: the tunnel stops counting, against its
// caller's limit (release) and in the listings, before its caller can
// learn that it ended and dial again.
func (s *Service) spliced(release func()) (ended func()) {
	s.active.Add(1)
	metrics.Tunnels.Inc()
	return func() {
		release()
		s.active.Add(-1)
		metrics.Tunnels.Dec()
	}
}

// ended audits and logs the end of tunnel t.
func (s *Service) ended(t *tunnel.Tunnel, callerStatus, agentStatus error, log *slog.Logger) {
	s.audit(t, callerStatus)
	if agentStatus != nil {
		log.Info("tunnel ended", "caller_code", status.Code(callerStatus).String(),
			"agent_code", status.Code(agentStatus).String(), "error", status.Convert(agentStatus).Message())
	} else {
		log.Debug("tunnel closed")
	}
}
