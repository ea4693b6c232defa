package agent

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io"
	"log/slog"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kcp-dev/tunnel-broker/broker/internal/quota"
	"github.com/kcp-dev/tunnel-broker/broker/internal/receive"
	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/broker/registry"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// Connect implements AgentService.Connect: a registration, then dial orders
// out and dial failures in, until either side ends the stream.
func (s *Service) Connect(stream tunnelv1.AgentService_ConnectServer) error {
	start := s.cfg.Clock.Now()
	id, ok := identity.PeerID(stream.Context())
	if !ok {
		return status.Error(codes.Unauthenticated, "no SPIFFE ID")
	}
	// A control stream holds a registration from its start, so that
	// streams that have not registered yet count too.
	release, err := s.holdRegistration(id)
	if err != nil {
		return err
	}
	defer release()
	a, err := s.register(stream, id, start)
	if err != nil {
		return err
	}
	// Routable before the agent hears it is registered, so that its
	// registration is in force once it knows.
	s.cfg.Registry.Register(a)
	defer s.cfg.Registry.Unregister(a)
	registered := &tunnelv1.ConnectResponse{Message: &tunnelv1.ConnectResponse_Registered{Registered: &tunnelv1.Registered{
		BrokerId: s.cfg.BrokerID,
		Since:    timestamppb.New(a.Since),
	}}}
	if s.cfg.MaxConnectionAge > 0 {
		registered.GetRegistered().MaxConnectionAge = durationpb.New(s.cfg.MaxConnectionAge)
	}
	if err := stream.Send(registered); err != nil {
		return err
	}
	log := s.cfg.Log.With("agent", a.String(), "session", a.SessionID)
	log.Info("agent registered", "clusters", len(a.Clusters))
	log.Debug("agent clusters", "clusters", a.Clusters)
	metrics.Registrations.Inc()
	series := metrics.NewAgentSeries(a.Name, a.ID.String())
	defer series.End()
	// The registration itself came over the path: reachable until a probe
	// goes unanswered or the stream ends.
	series.Reachable(true)
	return s.serve(stream, a, newProber(a, series, s.cfg.Clock), log)
}

// holdRegistration counts one more control stream against id, unless it
// holds its limit; release gives it back.
func (s *Service) holdRegistration(id spiffeid.ID) (release func(), err error) {
	release, over := s.registrations.Take(id)
	if over == quota.Under {
		return release, nil
	}
	metrics.LimitsHit.WithLabelValues("registrations_per_agent").Inc()
	s.cfg.Log.Warn("registration refused: agent at its limit", "peer", id.String(), "limit", s.registrations.PerID)
	return nil, status.Errorf(codes.ResourceExhausted, "%s already holds %d registrations with this broker replica, the most an agent may", id, s.registrations.PerID)
}

// register receives the first registration, with all its clusters, and
// makes the agent it registers.
func (s *Service) register(stream tunnelv1.AgentService_ConnectServer, id spiffeid.ID, start time.Time) (*registry.Agent, error) {
	first, err := receive.First[tunnelv1.ConnectRequest](stream, "stream closed before registering")
	if err != nil {
		return nil, err
	}
	reg := first.GetRegister()
	if reg == nil {
		return nil, status.Error(codes.InvalidArgument, "the first message on a control stream must be a registration")
	}
	if err := tunnelv1.ValidateAgentName(reg.GetAgentName()); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	clusters, err := s.firstClusters(stream, id, reg, start)
	if err != nil {
		return nil, err
	}
	return registry.NewAgent(sessionID(), id, reg.GetAgentName(), clusters), nil
}

// serve sends a registered agent its dial orders, probes and the broker's
// drain, and takes its messages (receive), until either side ends the
// stream, the broker's grace period is over, or the agent's SVID expires.
func (s *Service) serve(stream tunnelv1.AgentService_ConnectServer, a *registry.Agent, probes *prober, log *slog.Logger) error {
	received := make(chan error, 1)
	go func() { received <- s.receive(stream, a, probes, log) }()
	tick := s.cfg.Clock.NewTicker(s.cfg.ProbeEvery)
	defer tick.Stop()
	// A registration lasts as long as the SVID it was made with: the agent
	// must come back with a current one, on a new connection.
	svid, _ := identity.Peer(stream.Context())
	expiry := s.cfg.Clock.NewTimer(svid.Expires.Sub(s.cfg.Clock.Now()))
	defer expiry.Stop()
	draining := s.cfg.Draining.Done()
	replicas, msg := s.replicas()
	for {
		if msg != nil {
			if err := stream.Send(msg); err != nil {
				log.Info("agent disconnected", "error", err)
				return err
			}
		}
		msg = nil
		select {
		case <-replicas:
			replicas, msg = s.replicas()
		case <-expiry.C():
			log.Warn("agent SVID expired, registration ended", "expired", svid.Expires)
			return identity.ExpiredError(svid)
		case <-tick.C():
			msg = probes.next()
		case <-draining:
			draining = nil // tell once
			msg = &tunnelv1.ConnectResponse{Message: &tunnelv1.ConnectResponse_Drain{Drain: &tunnelv1.Drain{GraceMs: uint32(s.cfg.Grace.Milliseconds())}}}
		case <-s.cfg.Stopping.Done():
			return status.Error(codes.Unavailable, "the broker is shutting down")
		case order := <-a.Orders():
			msg = &tunnelv1.ConnectResponse{Message: &tunnelv1.ConnectResponse_DialOrder{DialOrder: order}}
		case err := <-received:
			if err != nil {
				log.Info("agent disconnected", "error", err)
			} else {
				log.Info("agent unregistered")
			}
			return err
		}
	}
}

// replicas is the message that tells an agent the count of replicas (nil
// while it is unknown), and a channel closed when the count changes (nil:
// never, when the broker does not count them).
func (s *Service) replicas() (changed <-chan struct{}, msg *tunnelv1.ConnectResponse) {
	if s.cfg.Replicas == nil {
		return nil, nil
	}
	n, changed := s.cfg.Replicas.Count()
	if n <= 0 {
		return changed, nil
	}
	return changed, &tunnelv1.ConnectResponse{Message: &tunnelv1.ConnectResponse_Replicas{Replicas: &tunnelv1.Replicas{Count: uint32(n)}}}
}

// receive takes the agent's messages after its registration, until it ends
// its side of the stream.
func (s *Service) receive(stream tunnelv1.AgentService_ConnectServer, a *registry.Agent, probes *prober, log *slog.Logger) error {
	var update *clusterSet // a registration's clusters while more of them come
	paced := s.newReregistrations(a, log)
	defer paced.stop()
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
			s.cfg.Registry.Fail(a, m.DialFailure)
		case *tunnelv1.ConnectRequest_Probe:
			probes.answered(m.Probe.GetSequence())
		case *tunnelv1.ConnectRequest_Drain:
			a.Drain()
			log.Info("agent draining", "grace", time.Duration(m.Drain.GetGraceMs())*time.Millisecond, "tunnels", a.Tunnels())
		case *tunnelv1.ConnectRequest_Register:
			if update == nil {
				update = s.newClusterSet()
			}
			if err := s.reRegister(a, update, m.Register, paced); err != nil {
				return err
			}
			if !m.Register.GetMore() {
				update = nil
			}
		default:
			return status.Error(codes.InvalidArgument, "after registering, an agent may only report dial failures or re-register")
		}
	}
}

// reRegister adds the clusters of reg, a later registration, to update, and
// hands the set to paced with its last register.
func (s *Service) reRegister(a *registry.Agent, update *clusterSet, reg *tunnelv1.Register, paced *reregistrations) error {
	if err := tunnelv1.ValidateAgentName(reg.GetAgentName()); err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	if err := s.addClusters(update, a.ID, reg); err != nil {
		return err
	}
	if reg.GetMore() {
		return nil
	}
	paced.submit(update.all)
	return nil
}

func sessionID() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
