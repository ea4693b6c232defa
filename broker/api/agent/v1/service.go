// Package agent serves kcp.tunnel.v1.AgentService: agents register the
// logical clusters they serve on a control stream, and open one Tunnel
// stream per dial the broker orders.
package agent

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io"
	"log/slog"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
	"k8s.io/utils/clock"

	"github.com/kcp-dev/tunnel-broker/broker/internal/abortable"
	"github.com/kcp-dev/tunnel-broker/broker/internal/quota"
	"github.com/kcp-dev/tunnel-broker/broker/internal/receive"
	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/broker/registry"
	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// Defaults for the limits of Service.
const (
	// DefaultMaxRegistrations is how many control streams one agent
	// SPIFFE ID may hold with a replica: an agent holds one per replica it
	// reaches (with this one, one), and one more while it reconnects before
	// the broker has seen its old stream end.
	DefaultMaxRegistrations = 16
	// DefaultMaxClusters is how many logical clusters one registration may
	// serve: thousands of workspaces bound to one sync target fit.
	DefaultMaxClusters = 10000

	defaultTimeout = 5 * time.Second
)

// Service implements AgentService.
type Service struct {
	tunnelv1.UnimplementedAgentServiceServer

	Registry *registry.Registry
	Policy   *policy.Policy
	BrokerID string
	// Draining closes when the broker stops taking dials: agents are told,
	// with Grace as the time tunnels in flight still have. Stopping ends
	// when that time is over: control streams end.
	Draining <-chan struct{}
	Stopping context.Context
	Grace    time.Duration
	// ProbeEvery is how often each agent is probed over its control
	// stream; 0 means DefaultProbeEvery.
	ProbeEvery time.Duration
	// Timeout bounds the first registration, all its Register messages,
	// from the control stream's start; 0 means 5s, the broker's default
	// dial timeout.
	Timeout time.Duration
	// Registrations bounds the control streams of one SPIFFE ID, each
	// counted from its start (PerID; the zero Quota: no limit).
	Registrations quota.Quota
	// MaxClusters bounds the clusters of one registration; 0: no limit.
	MaxClusters int
	// Clock times the probes, the first registration and the end of each
	// registration at its SVID's expiry; nil: the real clock.
	Clock clock.WithTickerAndDelayedExecution
	Log   *slog.Logger
}

// Register adds the service to s.
func (s *Service) Register(srv *grpc.Server) { tunnelv1.RegisterAgentServiceServer(srv, s) }

// Connect implements AgentService.Connect: registration, then dial orders out
// and dial failures in, until either side ends the stream.
func (s *Service) Connect(stream tunnelv1.AgentService_ConnectServer) error {
	start := s.clock().Now()
	ctx := stream.Context()
	id, ok := identity.PeerID(ctx)
	if !ok {
		return status.Error(codes.Unauthenticated, "no SPIFFE ID")
	}
	// A control stream holds a registration from its start, so that
	// streams that have not registered yet count too.
	release, over := s.Registrations.Take(id)
	if over != quota.Under {
		metrics.LimitsHit.WithLabelValues("registrations_per_agent").Inc()
		s.Log.Warn("registration refused: agent at its limit", "peer", id.String(), "limit", s.Registrations.PerID)
		return status.Errorf(codes.ResourceExhausted, "%s already holds %d registrations with this broker replica, the most an agent may", id, s.Registrations.PerID)
	}
	defer release()
	first, err := receive.First[tunnelv1.ConnectRequest](stream, "stream closed before registering")
	if err != nil {
		return err
	}
	reg := first.GetRegister()
	if reg == nil {
		return status.Error(codes.InvalidArgument, "the first message on a control stream must be a registration")
	}
	if err := tunnelv1.ValidateAgentName(reg.GetAgentName()); err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	clusters, err := s.firstClusters(stream, id, reg, start)
	if err != nil {
		return err
	}

	a := registry.NewAgent(sessionID(), id, reg.GetAgentName(), clusters)
	log := s.Log.With("agent", a.String(), "session", a.SessionID)
	registered := &tunnelv1.ConnectResponse{Message: &tunnelv1.ConnectResponse_Registered{Registered: &tunnelv1.Registered{
		BrokerId: s.BrokerID,
		Since:    timestamppb.New(a.Since),
	}}}
	// Routable before the agent hears it is registered, so that its
	// registration is in force once it knows.
	s.Registry.Register(a)
	defer s.Registry.Unregister(a)
	if err := stream.Send(registered); err != nil {
		return err
	}
	log.Info("agent registered", "clusters", len(a.Clusters))
	log.Debug("agent clusters", "clusters", a.Clusters)
	metrics.Registrations.Inc()
	series := metrics.NewAgentSeries(a.Name, a.ID.String())
	defer series.End()
	// The registration itself came over the path: reachable until a probe
	// goes unanswered or the stream ends.
	series.Reachable(true)

	probes := newProber(a, series, s.clock())
	every := s.ProbeEvery
	if every <= 0 {
		every = DefaultProbeEvery
	}
	tick := s.clock().NewTicker(every)
	defer tick.Stop()
	recvErr := make(chan error, 1)
	go func() { recvErr <- s.receive(stream, a, probes, log) }()
	draining := s.Draining
	// A registration lasts as long as the SVID it was made with: the agent
	// must come back with a current one (on a new connection).
	svid, _ := identity.Peer(ctx)
	expiry := s.clock().NewTimer(svid.Expires.Sub(s.clock().Now()))
	defer expiry.Stop()
	for {
		select {
		case <-expiry.C():
			log.Warn("agent SVID expired, registration ended", "expired", svid.Expires)
			return identity.ExpiredError(svid)
		case <-tick.C():
			if err := stream.Send(probes.next()); err != nil {
				return err
			}
		case <-draining:
			draining = nil // tell once
			drain := &tunnelv1.ConnectResponse{Message: &tunnelv1.ConnectResponse_Drain{Drain: &tunnelv1.Drain{GraceMs: uint32(s.Grace.Milliseconds())}}}
			if err := stream.Send(drain); err != nil {
				return err
			}
		case <-s.Stopping.Done():
			return status.Error(codes.Unavailable, "the broker is shutting down")
		case order := <-a.Orders():
			if err := stream.Send(&tunnelv1.ConnectResponse{Message: &tunnelv1.ConnectResponse_DialOrder{DialOrder: order}}); err != nil {
				log.Info("agent disconnected", "error", err)
				return err
			}
		case err := <-recvErr:
			if err != nil {
				log.Info("agent disconnected", "error", err)
			} else {
				log.Info("agent unregistered")
			}
			return err
		}
	}
}

// firstClusters gathers the clusters of the first registration, which
// starts with reg and goes on while its messages set more. All of it must
// arrive within the timeout, counted from start.
func (s *Service) firstClusters(stream tunnelv1.AgentService_ConnectServer, id spiffeid.ID, reg *tunnelv1.Register, start time.Time) ([]string, error) {
	set := s.newClusterSet()
	if err := s.addClusters(set, id, reg); err != nil {
		return nil, err
	}
	if !reg.GetMore() {
		return set.list(), nil
	}
	timeout := s.Timeout
	if timeout <= 0 {
		timeout = defaultTimeout
	}
	late := status.Errorf(codes.DeadlineExceeded, "the registration's clusters did not all arrive within %v: its last register must not set more", timeout)
	timer := s.clock().AfterFunc(start.Add(timeout).Sub(s.clock().Now()), func() {
		metrics.LimitsHit.WithLabelValues("first_message_timeout").Inc()
		abortable.End(stream.Context(), late)
	})
	defer timer.Stop()
	for reg.GetMore() {
		msg, err := receive.Message[tunnelv1.ConnectRequest](stream)
		if errors.Is(err, io.EOF) {
			return nil, status.Error(codes.InvalidArgument, "stream closed before the registration's last register")
		}
		if err != nil {
			return nil, err
		}
		if reg = msg.GetRegister(); reg == nil {
			return nil, status.Error(codes.InvalidArgument, "a register with more must be followed by a register")
		}
		if err := s.addClusters(set, id, reg); err != nil {
			return nil, err
		}
	}
	if !timer.Stop() {
		return nil, late
	}
	return set.list(), nil
}

// receive takes dial failures from the agent until it closes its side.
func (s *Service) receive(stream tunnelv1.AgentService_ConnectServer, a *registry.Agent, probes *prober, log *slog.Logger) error {
	var update *clusterSet // a registration's clusters while more of them come
	for {
		msg, err := receive.Message[tunnelv1.ConnectRequest](stream)
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		switch m := msg.GetMessage().(type) {
		case *tunnelv1.ConnectRequest_DialFailure:
			s.Registry.Fail(a, m.DialFailure)
		case *tunnelv1.ConnectRequest_Probe:
			probes.answered(m.Probe.GetSequence())
		case *tunnelv1.ConnectRequest_Drain:
			a.Drain()
			log.Info("agent draining", "grace", time.Duration(m.Drain.GetGraceMs())*time.Millisecond, "tunnels", a.Tunnels())
		case *tunnelv1.ConnectRequest_Register:
			if err := tunnelv1.ValidateAgentName(m.Register.GetAgentName()); err != nil {
				return status.Error(codes.InvalidArgument, err.Error())
			}
			if update == nil {
				update = s.newClusterSet()
			}
			if err := s.addClusters(update, a.ID, m.Register); err != nil {
				return err
			}
			if m.Register.GetMore() {
				continue
			}
			clusters := update.list()
			update = nil
			s.Registry.Update(a, clusters)
			log.Info("agent clusters changed", "clusters", len(clusters))
			log.Debug("agent clusters", "clusters", clusters)
		default:
			return status.Error(codes.InvalidArgument, "after registering, an agent may only report dial failures or re-register")
		}
	}
}

// clusterSet gathers the clusters of one registration, told in one
// register or several, each once.
type clusterSet struct {
	max  int
	seen map[string]struct{}
	all  []string
}

func (s *Service) newClusterSet() *clusterSet {
	return &clusterSet{max: s.MaxClusters, seen: map[string]struct{}{}}
}

func (c *clusterSet) list() []string { return c.all }

// addClusters checks the clusters of reg, names then policy, and adds them
// to set. A claim the policy refuses ends the control stream, and nothing
// of it is routed. An agent may serve no cluster for a while (a sync target
// no workspace uses yet).
func (s *Service) addClusters(set *clusterSet, id spiffeid.ID, reg *tunnelv1.Register) error {
	clusters := reg.GetClusters()
	for _, c := range clusters {
		if err := tunnelv1.ValidateClusterName(c); err != nil {
			return status.Error(codes.InvalidArgument, err.Error())
		}
	}
	if err := s.Policy.MayServe(id, clusters); err != nil {
		metrics.Denied.WithLabelValues("Register").Inc()
		s.Log.Warn("permission denied", "peer", id.String(), "error", err)
		return status.Error(codes.PermissionDenied, err.Error())
	}
	for _, c := range clusters {
		if _, ok := set.seen[c]; ok {
			continue
		}
		if set.max > 0 && len(set.all) >= set.max {
			metrics.LimitsHit.WithLabelValues("clusters_per_registration").Inc()
			return status.Errorf(codes.ResourceExhausted, "a registration may serve at most %d logical clusters", set.max)
		}
		set.seen[c] = struct{}{}
		set.all = append(set.all, c)
	}
	return nil
}

// Tunnel implements AgentService.Tunnel: the first message names the dial;
// the stream is then handed to that dial, which splices and finishes it.
func (s *Service) Tunnel(stream tunnelv1.AgentService_TunnelServer) error {
	id, ok := identity.PeerID(stream.Context())
	if !ok {
		return status.Error(codes.Unauthenticated, "no SPIFFE ID")
	}
	first, err := receive.First[tunnelv1.TunnelRequest](stream, "stream closed before naming its dial")
	if err != nil {
		return err
	}
	open := first.GetOpen()
	if open == nil {
		return status.Error(codes.InvalidArgument, "the first message on a tunnel must name its dial")
	}
	return tunnel.Open(s.Registry, open.GetDialId(), id, stream)
}

func (s *Service) clock() clock.WithTickerAndDelayedExecution {
	if s.Clock == nil {
		return clock.RealClock{}
	}
	return s.Clock
}

func sessionID() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
