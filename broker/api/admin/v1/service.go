// Package admin serves kcp.tunnel.v1.AdminService: what a replica knows of
// its agents (ListAgents) and its tunnels (tunnels.go), for operators
// (grpcurl, tunnelctl).
package admin

import (
	"cmp"
	"context"
	"slices"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kcp-dev/tunnel-broker/broker/registry"
	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// Config is what the admin service needs.
type Config struct {
	Registry *registry.Registry
	// Tunnels are the tunnels open through the replica.
	Tunnels *tunnel.Table
	// BrokerID names this replica in listings.
	BrokerID string
}

// Service implements AdminService.
type Service struct {
	tunnelv1.UnimplementedAdminServiceServer

	cfg Config
}

// New is an admin service with cfg.
func New(cfg Config) *Service { return &Service{cfg: cfg} }

// RegisterService registers s on srv.
func RegisterService(srv grpc.ServiceRegistrar, s *Service) {
	tunnelv1.RegisterAdminServiceServer(srv, s)
}

// ListAgents implements AdminService.ListAgents. A cluster filter that is
// no logical cluster name (a path, say) is refused, as ListTunnels refuses
// it: no agent could serve it, and an empty list would hide the mistake.
func (s *Service) ListAgents(_ context.Context, req *tunnelv1.ListAgentsRequest) (*tunnelv1.ListAgentsResponse, error) {
	if c := req.GetCluster(); c != "" {
		if err := tunnelv1.ValidateClusterName(c); err != nil {
			return nil, status.Errorf(codes.InvalidArgument, "cluster: %v", err)
		}
	}
	resp := &tunnelv1.ListAgentsResponse{BrokerId: s.cfg.BrokerID}
	for _, a := range s.cfg.Registry.Agents() {
		clusters := s.cfg.Registry.ClustersOf(a)
		if req.GetCluster() != "" && !slices.Contains(clusters, req.GetCluster()) {
			continue
		}
		slices.Sort(clusters)
		info := &tunnelv1.AgentInfo{
			Name:           a.Name,
			SpiffeId:       a.ID.String(),
			SessionId:      a.SessionID,
			Clusters:       clusters,
			ConnectedSince: timestamppb.New(a.Since),
			ActiveTunnels:  uint64(max(a.Tunnels(), 0)),
			Draining:       a.Draining(),
		}
		if at, rtt := a.LastProbe(); !at.IsZero() {
			info.LastProbe = timestamppb.New(at)
			info.LastProbeRtt = durationpb.New(rtt)
		}
		resp.Agents = append(resp.Agents, info)
	}
	slices.SortFunc(resp.Agents, func(x, y *tunnelv1.AgentInfo) int {
		return cmp.Or(strings.Compare(x.GetName(), y.GetName()), strings.Compare(x.GetSessionId(), y.GetSessionId()))
	})
	return resp, nil
}
