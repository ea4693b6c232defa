package agent

import (
	"errors"
	"io"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/broker/authz"
	"github.com/kcp-dev/tunnel-broker/broker/internal/receive"
	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// The clusters of a registration may come in several Register messages, all
// but the last with more set. Each is checked as it comes: names, then the
// policy, then the bound on a registration's clusters.

// clusterSet gathers the clusters of one registration, each once.
type clusterSet struct {
	max  int // <= 0: no limit
	seen map[string]struct{}
	all  []string
}

func (s *Service) newClusterSet() *clusterSet {
	return &clusterSet{max: s.cfg.MaxClusters, seen: map[string]struct{}{}}
}

// firstClusters gathers the clusters of the first registration, which
// starts with reg and goes on while its messages set more. All of it must
// arrive within the registration timeout, counted from start.
func (s *Service) firstClusters(stream tunnelv1.AgentService_ConnectServer, id spiffeid.ID, reg *tunnelv1.Register, start time.Time) ([]string, error) {
	set := s.newClusterSet()
	if err := s.addClusters(set, id, reg); err != nil {
		return nil, err
	}
	if !reg.GetMore() {
		return set.all, nil
	}
	timeout := s.cfg.RegistrationTimeout
	late := status.Errorf(codes.DeadlineExceeded, "the registration's clusters did not all arrive within %v: its last register must not set more", timeout)
	expired := make(chan struct{})
	timer := s.cfg.Clock.AfterFunc(start.Add(timeout).Sub(s.cfg.Clock.Now()), func() {
		metrics.LimitsHit.WithLabelValues("first_message_timeout").Inc()
		close(expired)
	})
	defer timer.Stop()
	for reg.GetMore() {
		msg, err := receive.MessageBefore[tunnelv1.ConnectRequest](stream, expired, late)
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
	return set.all, nil
}

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
	if err := s.cfg.Policy.MayServe(id, clusters); err != nil {
		return authz.Deny(s.cfg.Log, id.String(), authz.AskedServe, err.Error())
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
