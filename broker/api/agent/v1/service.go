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

	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/broker/registry"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
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
	Log        *slog.Logger
}

// Register adds the service to s.
func (s *Service) Register(srv *grpc.Server) { tunnelv1.RegisterAgentServiceServer(srv, s) }

// Connect implements AgentService.Connect: registration, then dial orders out
// and dial failures in, until either side ends the stream.
func (s *Service) Connect(stream tunnelv1.AgentService_ConnectServer) error {
	ctx := stream.Context()
	id, ok := identity.PeerID(ctx)
	if !ok {
		return status.Error(codes.Unauthenticated, "no SPIFFE ID")
	}
	first, err := stream.Recv()
	if errors.Is(err, io.EOF) {
		return status.Error(codes.InvalidArgument, "stream closed before registering")
	}
	if err != nil {
		return err
	}
	reg := first.GetRegister()
	if reg == nil {
		return status.Error(codes.InvalidArgument, "the first message on a control stream must be a registration")
	}
	if err := s.checkClusters(id, reg.GetClusters()); err != nil {
		return err
	}

	a := registry.NewAgent(sessionID(), id, reg.GetAgentName(), reg.GetClusters())
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
	log.Info("agent registered", "clusters", a.Clusters)
	metrics.Registrations.Inc()
	labels := []string{a.Name, a.ID.String()}
	// The registration itself came over the path: reachable until a probe
	// goes unanswered or the stream ends.
	metrics.Reachable.WithLabelValues(labels...).Set(1)
	defer metrics.Reachable.WithLabelValues(labels...).Set(0)

	probes := newProber(a, labels)
	every := s.ProbeEvery
	if every <= 0 {
		every = DefaultProbeEvery
	}
	tick := time.NewTicker(every)
	defer tick.Stop()
	recvErr := make(chan error, 1)
	go func() { recvErr <- s.receive(stream, a, probes, log) }()
	draining := s.Draining
	// A registration lasts as long as the SVID it was made with: the agent
	// must come back with a current one (on a new connection).
	svid, _ := identity.Peer(ctx)
	expiry := time.NewTimer(time.Until(svid.Expires))
	defer expiry.Stop()
	for {
		select {
		case <-expiry.C:
			log.Warn("agent SVID expired, registration ended", "expired", svid.Expires)
			return identity.ExpiredError(svid)
		case <-tick.C:
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

// receive takes dial failures from the agent until it closes its side.
func (s *Service) receive(stream tunnelv1.AgentService_ConnectServer, a *registry.Agent, probes *prober, log *slog.Logger) error {
	for {
		msg, err := stream.Recv()
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
			if err := s.checkClusters(a.ID, m.Register.GetClusters()); err != nil {
				return err
			}
			s.Registry.Update(a, m.Register.GetClusters())
			log.Info("agent clusters changed", "clusters", m.Register.GetClusters())
		default:
			return status.Error(codes.InvalidArgument, "after registering, an agent may only report dial failures or re-register")
		}
	}
}

// checkClusters checks the clusters an agent claims to serve: names, then
// policy. A claim the policy refuses ends the control stream, and nothing of
// it is routed. An agent may serve no cluster for a while (a sync target no
// workspace uses yet).
func (s *Service) checkClusters(id spiffeid.ID, clusters []string) error {
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
	return nil
}

// Tunnel implements AgentService.Tunnel: the first message names the dial;
// the stream is then handed to that dial, which splices and finishes it.
func (s *Service) Tunnel(stream tunnelv1.AgentService_TunnelServer) error {
	id, ok := identity.PeerID(stream.Context())
	if !ok {
		return status.Error(codes.Unauthenticated, "no SPIFFE ID")
	}
	first, err := stream.Recv()
	if errors.Is(err, io.EOF) {
		return status.Error(codes.InvalidArgument, "stream closed before naming its dial")
	}
	if err != nil {
		return err
	}
	open := first.GetOpen()
	if open == nil {
		return status.Error(codes.InvalidArgument, "the first message on a tunnel must name its dial")
	}
	t, err := s.Registry.Claim(open.GetDialId(), id, stream)
	if err != nil {
		return err
	}
	return t.Wait(stream.Context())
}

func sessionID() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
