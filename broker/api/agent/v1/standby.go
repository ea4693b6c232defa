package agent

import (
	"cmp"
	"errors"
	"io"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/broker/internal/receive"
	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/broker/registry"
	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// A standby stream (docs/protocol.md §3.2) is a Tunnel stream that an agent
// opens ahead of its dials: the broker writes a dial's order on it, from
// the stream's own handler, and the agent answers with the dial's open on
// the same stream, which then carries the tunnel. A dial so skips the hop
// through the control stream and the opening of a new stream on both
// sides. It is bounded like the rest: at most MaxStandbyStreams idle per
// registration, each ended with the registration, the broker's drain, or
// the agent's own half-close; an order unanswered past its timeout ends it.

// DefaultMaxStandbyStreams is how many idle standby streams one
// registration may hold: the agent keeps two, one to take the next dial
// while the other's replacement opens.
const DefaultMaxStandbyStreams = 4

// answerSlack is how long past an order's timeout its answer may come: the
// agent answers a target that did not connect in time at the timeout.
const answerSlack = time.Second

// received is a message of a standby stream, received in a goroutine of its
// own so that the handler waits for it beside its order.
type received struct {
	msg *tunnelv1.TunnelRequest
	err error
}

// standby serves a standby stream of the registration named registration,
// which must be one of peer's on this replica: it waits idle for one of the
// registration's dial orders, writes it, and then carries the dial as the
// Tunnel stream that the agent's open names.
func (s *Service) standby(stream tunnelv1.AgentService_TunnelServer, peer spiffeid.ID, registration string) error {
	a, ok := s.cfg.Registry.Registration(registration, peer)
	if !ok {
		return status.Errorf(codes.NotFound, "no registration %q of %s on this broker replica (it ended, or is another replica's)", registration, peer)
	}
	sb := registry.NewStandby()
	if !a.AddStandby(sb, s.cfg.MaxStandbyStreams) {
		metrics.LimitsHit.WithLabelValues("standby_streams").Inc()
		return status.Errorf(codes.ResourceExhausted, "the registration holds %d standby streams, the most it may (or it has ended)", max(s.cfg.MaxStandbyStreams, 0))
	}
	// The agent sends nothing on an idle standby but its half-close,
	// which ends it; the receive also takes the answer to the order.
	got := make(chan received, 1)
	go func() {
		msg, err := receive.Message[tunnelv1.TunnelRequest](stream)
		got <- received{msg, err}
	}()
	var order *tunnelv1.DialOrder
	select {
	case order = <-sb.Order():
	case r := <-got:
		if a.RemoveStandby(sb) {
			return idleEnd(r)
		}
		// An order took the standby as the agent closed it: the agent
		// still reads it, and answers it on its control stream.
		order = <-sb.Order()
		if r.msg != nil {
			s.cfg.Registry.Fail(a, lostOrder(order, "the agent's standby stream broke the protocol"))
			return idleEnd(r)
		}
		return s.carry(stream, peer, a, order, got, &r)
	case <-a.Gone():
		if a.RemoveStandby(sb) {
			return status.Error(codes.Unavailable, "the agent's registration ended")
		}
		order = <-sb.Order()
	case <-s.cfg.Draining.Done():
		if a.RemoveStandby(sb) {
			return status.Error(codes.Unavailable, "this broker replica is shutting down")
		}
		order = <-sb.Order()
	}
	return s.carry(stream, peer, a, order, got, nil)
}

// idleEnd is the status of a standby that ended before any order: OK for
// the agent's half-close, else why.
func idleEnd(r received) error {
	switch {
	case errors.Is(r.err, io.EOF):
		return nil
	case r.err != nil:
		return r.err
	}
	return status.Error(codes.InvalidArgument, "an idle standby stream may send nothing: the broker's order comes first")
}

// carry writes order on the standby stream and carries the dial once the
// agent answers it with its open there. An answer that is the agent's
// half-close leaves the dial to the agent's dial_failure on its control
// stream; anything else fails the dial here. ended is the end of the
// agent's side, if the receive brought it before the order.
func (s *Service) carry(stream tunnelv1.AgentService_TunnelServer, peer spiffeid.ID, a *registry.Agent, order *tunnelv1.DialOrder, got chan received, ended *received) error {
	if err := stream.Send(&tunnelv1.TunnelResponse{Frame: &tunnelv1.TunnelResponse_DialOrder{DialOrder: order}}); err != nil {
		s.cfg.Registry.Fail(a, lostOrder(order, "the agent's standby stream failed as its order was written"))
		return err
	}
	var r received
	if ended != nil {
		r = *ended
	} else {
		timeout := cmp.Or(time.Duration(order.GetTimeoutMs())*time.Millisecond, DefaultRegistrationTimeout) + answerSlack
		timer := s.cfg.Clock.NewTimer(timeout)
		defer timer.Stop()
		select {
		case r = <-got:
		case <-timer.C():
			s.cfg.Registry.Fail(a, &tunnelv1.DialFailure{DialId: order.GetDialId(), Code: int32(codes.DeadlineExceeded),
				Message: "the agent did not answer in time"})
			return status.Errorf(codes.DeadlineExceeded, "no answer to the dial order within %v", timeout)
		}
	}
	switch {
	case errors.Is(r.err, io.EOF):
		// The agent could not serve the dial: its dial_failure is on
		// its control stream.
		return nil
	case r.err != nil:
		s.cfg.Registry.Fail(a, lostOrder(order, "the agent's standby stream ended before it answered"))
		return r.err
	case r.msg.GetOpen().GetDialId() != order.GetDialId() || r.msg.GetOpen().GetStandbyFor() != "":
		s.cfg.Registry.Fail(a, lostOrder(order, "the agent answered its order with something else than the dial's open"))
		return status.Error(codes.InvalidArgument, "a standby stream answers its order with open{dial_id} of that order")
	}
	return tunnel.Open(s.cfg.Registry, order.GetDialId(), peer, stream)
}

// lostOrder is the failure of a dial whose standby stream failed before
// the agent answered: Unavailable, so that another agent of the cluster
// may take it. An honest agent writes early data only after its open, so
// none reached the target.
func lostOrder(order *tunnelv1.DialOrder, why string) *tunnelv1.DialFailure {
	return &tunnelv1.DialFailure{DialId: order.GetDialId(), Code: int32(codes.Unavailable), Message: why}
}
