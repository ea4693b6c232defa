// Package dial serves kcp.tunnel.v1.DialService: a caller names a Service in
// a logical cluster and gets a byte stream to it through an agent.
package dial

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/utils/clock"

	"github.com/kcp-dev/tunnel-broker/broker/internal/receive"
	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/broker/registry"
	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// DefaultTimeout bounds a dial when the caller sets no shorter deadline. It
// sits below the admission webhook default of 10s, so a dial that cannot
// succeed fails with its own status, not the webhook's timeout.
const DefaultTimeout = 5 * time.Second

// Service implements DialService.
type Service struct {
	tunnelv1.UnimplementedDialServiceServer

	Registry *registry.Registry
	Policy   *policy.Policy
	Timeout  time.Duration
	// IdleTimeout ends tunnels that carry nothing for this long; 0: never.
	IdleTimeout time.Duration
	// MaxTunnelsPerCaller bounds the tunnels one SPIFFE ID holds; 0: none.
	MaxTunnelsPerCaller int64
	// Draining closes when the broker stops taking dials; Stopping ends
	// when its grace period for tunnels in flight is over.
	Draining <-chan struct{}
	Stopping context.Context
	// Clock times the idle limit; nil: the real clock.
	Clock clock.WithDelayedExecution
	Log   *slog.Logger

	active    atomic.Int64
	perCaller sync.Map // spiffeid.ID -> *atomic.Int64
}

// Active is the number of tunnels spliced right now.
func (s *Service) Active() int64 { return s.active.Load() }

// Register adds the service to s.
func (s *Service) Register(srv *grpc.Server) { tunnelv1.RegisterDialServiceServer(srv, s) }

// Dial implements DialService.Dial.
func (s *Service) Dial(stream tunnelv1.DialService_DialServer) error {
	caller, _ := identity.PeerID(stream.Context())
	// A dial counts against its caller's tunnels from its start, so that
	// dials that have not named their target yet count too.
	held := s.callerTunnels(caller)
	if n := held.Add(1); s.MaxTunnelsPerCaller > 0 && n > s.MaxTunnelsPerCaller {
		held.Add(-1)
		metrics.LimitsHit.WithLabelValues("tunnels_per_caller").Inc()
		s.Log.Warn("dial refused: caller at its tunnel limit", "caller", caller.String(), "limit", s.MaxTunnelsPerCaller)
		metrics.Dials.WithLabelValues(codes.ResourceExhausted.String()).Inc()
		return status.Errorf(codes.ResourceExhausted, "%s already holds %d tunnels, the most a caller may", caller, s.MaxTunnelsPerCaller)
	}
	unhold := sync.OnceFunc(func() { held.Add(-1) })
	defer unhold()

	target, err := recvTarget(stream)
	if err != nil {
		return err
	}
	if err := s.Policy.MayDial(caller, target.GetCluster()); err != nil {
		metrics.Denied.WithLabelValues("Dial").Inc()
		s.Log.Warn("permission denied", "peer", caller.String(), "cluster", target.GetCluster())
		return status.Error(codes.PermissionDenied, err.Error())
	}
	log := s.Log.With("cluster", target.GetCluster(), "namespace", target.GetNamespace(),
		"service", target.GetService(), "port", target.GetPort(), "caller", caller.String())
	if isClosed(s.Draining) {
		return status.Error(codes.Unavailable, "this broker replica is shutting down: dial another")
	}

	start := time.Now()
	t, err := s.dial(stream.Context(), target)
	took := time.Since(start)
	code := status.Code(err)
	metrics.Dials.WithLabelValues(code.String()).Inc()
	metrics.DialSeconds.WithLabelValues(code.String()).Observe(took.Seconds())
	if err != nil {
		if limit, ok := errors.AsType[*registry.LimitError](err); ok {
			metrics.LimitsHit.WithLabelValues(limit.Limit).Inc()
		}
		if failed, ok := errors.AsType[*registry.DialError](err); ok {
			log = log.With(failed.LogAttrs()...)
		}
		log.Info("dial failed", "code", code.String(), "error", status.Convert(err).Message(), "took", took)
		return err
	}
	log = log.With("tunnel", t.ID, "agent", t.Agent.String())
	established := &tunnelv1.DialResponse{Frame: &tunnelv1.DialResponse_Established{Established: &tunnelv1.Established{TunnelId: t.ID}}}
	if err := stream.Send(established); err != nil {
		t.End(status.Error(codes.Canceled, "caller went away"))
		return err
	}
	log.Debug("tunnel established", "took", took)

	s.active.Add(1)
	metrics.Tunnels.Inc()
	// The tunnel stops counting (against the limits, in the listings)
	// before its caller can learn that it ended and dial again.
	ended := func() {
		unhold()
		s.active.Add(-1)
		metrics.Tunnels.Dec()
	}
	idle := s.IdleTimeout
	if idle <= 0 {
		idle = -1 // never
	}
	callerStatus, agentStatus := t.Splice(stream, tunnel.Config{IdleTimeout: idle, Stopping: s.Stopping, Clock: s.Clock}, ended)
	if agentStatus != nil {
		log.Info("tunnel ended", "caller_code", status.Code(callerStatus).String(), "agent_code", status.Code(agentStatus).String(), "error", status.Convert(agentStatus).Message())
	} else {
		log.Debug("tunnel closed")
	}
	return callerStatus
}

// recvTarget receives the first message of a dial, which must name a valid
// target.
func recvTarget(stream tunnelv1.DialService_DialServer) (*tunnelv1.Target, error) {
	first, err := receive.First[tunnelv1.DialRequest](stream, "stream closed before naming a target")
	if err != nil {
		return nil, err
	}
	target := first.GetTarget()
	if target == nil {
		return nil, status.Error(codes.InvalidArgument, "the first message of a dial must name a target")
	}
	if err := target.Validate(); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	return target, nil
}

func (s *Service) dial(ctx context.Context, target *tunnelv1.Target) (*tunnel.Tunnel, error) {
	timeout := s.Timeout
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	return tunnel.Dial(ctx, s.Registry, target)
}

func (s *Service) callerTunnels(id spiffeid.ID) *atomic.Int64 {
	n, _ := s.perCaller.LoadOrStore(id, new(atomic.Int64))
	return n.(*atomic.Int64)
}

func isClosed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}
