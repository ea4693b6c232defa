package admin

import (
	"context"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// A replica may carry tens of thousands of tunnels, so ListTunnels answers a
// page at a time, in the order of tunnel ids: a response holds at most
// MaxPageSize tunnels (about 300 bytes each), and the next page starts
// after the last id of this one.
const (
	DefaultPageSize = 100
	MaxPageSize     = 1000
)

// ListTunnels implements AdminService.ListTunnels.
func (s *Service) ListTunnels(_ context.Context, req *tunnelv1.ListTunnelsRequest) (*tunnelv1.ListTunnelsResponse, error) {
	f, err := filter(req)
	if err != nil {
		return nil, err
	}
	infos, more := s.cfg.Tunnels.List(f)
	resp := &tunnelv1.ListTunnelsResponse{BrokerId: s.cfg.BrokerID}
	now := time.Now()
	for _, t := range infos {
		resp.Tunnels = append(resp.Tunnels, &tunnelv1.TunnelInfo{
			TunnelId:       t.ID,
			CallerSpiffeId: t.Caller,
			Target:         t.Target,
			AgentName:      t.Agent.Name,
			AgentSpiffeId:  t.Agent.ID.String(),
			AgentSessionId: t.Agent.SessionID,
			BrokerId:       s.cfg.BrokerID,
			Established:    timestamppb.New(t.Established),
			Age:            durationpb.New(now.Sub(t.Established)),
			BytesUp:        uint64(t.BytesUp),
			BytesDown:      uint64(t.BytesDown),
			Idle:           durationpb.New(t.Idle),
			TraceId:        t.TraceID,
		})
	}
	if more {
		resp.NextPageToken = infos[len(infos)-1].ID
	}
	return resp, nil
}

// filter is the request's selection, checked: a caller that is a SPIFFE ID,
// a page token that is a tunnel id, a page size within MaxPageSize.
func filter(req *tunnelv1.ListTunnelsRequest) (tunnel.Filter, error) {
	f := tunnel.Filter{Cluster: req.GetCluster(), After: req.GetPageToken(), Limit: int(req.GetPageSize())}
	if f.Limit == 0 {
		f.Limit = DefaultPageSize
	}
	if f.Limit > MaxPageSize {
		return f, status.Errorf(codes.InvalidArgument, "page_size %d is over %d, the most a page holds", f.Limit, MaxPageSize)
	}
	if f.Cluster != "" {
		if err := tunnelv1.ValidateClusterName(f.Cluster); err != nil {
			return f, status.Errorf(codes.InvalidArgument, "cluster: %v", err)
		}
	}
	if c := req.GetCallerSpiffeId(); c != "" {
		id, err := spiffeid.FromString(c)
		if err != nil {
			return f, status.Errorf(codes.InvalidArgument, "caller_spiffe_id: %v", err)
		}
		f.Caller = id
	}
	if !validPageToken(f.After) {
		return f, status.Error(codes.InvalidArgument, "page_token is not a tunnel id: pass a response's next_page_token")
	}
	return f, nil
}

// validPageToken: empty, or a tunnel id (16 lowercase hex digits).
func validPageToken(s string) bool {
	if s == "" {
		return true
	}
	if len(s) != 16 {
		return false
	}
	for _, c := range s {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}
