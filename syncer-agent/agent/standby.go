package agent

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// DefaultStandbyStreams is how many standby Tunnel streams an agent keeps
// open for each registration whose broker offers them, unless
// Agent.StandbyStreams says otherwise.
const DefaultStandbyStreams = 2

// Waits before a standby stream is opened again after one ended without an
// order (the broker refused it or ended it) or could not be opened:
// exponential with jitter, so that a broker that refuses standby streams
// is not asked again in a tight loop. A standby stream that lived longer
// than the longest wait starts the waits over.
const (
	minStandbyRetry = time.Second
	maxStandbyRetry = 30 * time.Second
)

// standbyCount is how many standby streams to keep for the registration
// the broker confirmed: as many as the agent wants, at most as many as the
// broker keeps, and none if the broker named no registration.
func (a *Agent) standbyCount(confirmed *tunnelv1.Registered) int {
	if confirmed.GetRegistrationId() == "" || a.StandbyStreams < 0 {
		return 0
	}
	want := cmp.Or(a.StandbyStreams, DefaultStandbyStreams)
	return int(min(uint64(want), uint64(confirmed.GetMaxStandbyStreams())))
}

// standbys are a session's standby Tunnel streams: streams opened ahead of
// any order, on which the broker writes a dial order itself, which saves
// the dial the hop over the control stream and the opening of a stream.
// Each is one goroutine (keep) that opens a stream, waits for its order
// and serves it: with open{dial_id} on that same stream, after which it is
// the dial's tunnel as any other, or with a dial_failure on the control
// stream, exactly as an order that came there. A nil *standbys keeps none.
type standbys struct {
	r       *agentRun
	control *controlStream
	regID   string
	log     *slog.Logger
	// ctx ends with the session: the idle standby streams are cancelled
	// then, and their goroutines return.
	ctx context.Context
	end context.CancelFunc
	// idle counts the goroutines that carry no tunnel (yet); one that
	// does is counted in the run's tunnels instead.
	idle sync.WaitGroup

	mu sync.Mutex
	// waiting are the streams that wait for their order.
	waiting map[*standby]struct{}
	// closing says that the agent drains: no new standby stream is
	// opened, and the idle ones are closed.
	closing bool
}

// standby is one standby stream.
type standby struct {
	stream tunnelv1.AgentService_TunnelClient
	// cancel ends the stream. detach keeps the session's end from
	// cancelling it, and reports whether it has not done so already.
	cancel context.CancelFunc
	detach func() bool
	// closed says that its send direction was closed while it waited,
	// as the agent drains; it is set under standbys.mu, and read by its
	// goroutine once the stream no longer waits.
	closed bool
}

// release stops the stream and its link to the session.
func (sb *standby) release() {
	sb.detach()
	sb.cancel()
}

// startStandbys keeps the session's standby streams open, if the broker
// offers them, until the session's ctx ends or the agent drains.
func (r *agentRun) startStandbys(ctx context.Context, control *controlStream, confirmed *tunnelv1.Registered) *standbys {
	n := r.standbyCount(confirmed)
	if n == 0 {
		return nil
	}
	ctx, end := context.WithCancel(ctx)
	s := &standbys{
		r: r, control: control, regID: confirmed.GetRegistrationId(),
		log: r.Log.With("broker", r.Broker, "registration", confirmed.GetRegistrationId()),
		ctx: ctx, end: end, waiting: map[*standby]struct{}{},
	}
	s.log.Debug("keeping standby streams", "streams", n)
	s.idle.Add(n)
	for range n {
		go s.keep()
	}
	return s
}

// stop ends the idle standby streams and waits for their goroutines.
func (s *standbys) stop() {
	if s == nil {
		return
	}
	s.end()
	s.idle.Wait()
}

// drain opens no more standby streams, and closes the send direction of
// those that wait: the broker ends them (their goroutines read them to
// their end, and refuse an order that crossed the close).
func (s *standbys) drain() {
	if s == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closing = true
	for sb := range s.waiting {
		sb.closed = true
		_ = sb.stream.CloseSend()
	}
	clear(s.waiting)
}

// wanted says whether standby streams are still to be opened.
func (s *standbys) wanted() bool {
	s.mu.Lock()
	closing := s.closing
	s.mu.Unlock()
	select {
	case <-s.r.draining:
		return false
	default:
		return !closing && s.ctx.Err() == nil
	}
}

// keep opens a standby stream and waits for its order, again after a wait
// each time one ends without, until the session ends or the agent drains.
// Once it has its order, it starts its replacement and serves the order.
func (s *standbys) keep() {
	carrying := false
	defer func() {
		if !carrying {
			s.idle.Done()
		}
	}()
	retry := newBackoff(minStandbyRetry, maxStandbyRetry)
	for s.wanted() {
		opened := s.r.clock().Now()
		sb, order, err := s.await()
		if order != nil {
			s.replace()
			if sb.closed || !s.r.admit() {
				s.refuse(sb, order)
				return
			}
			// From here on the goroutine carries a tunnel, counted in the
			// run's tunnels (admit), which outlives the session.
			carrying = true
			s.idle.Done()
			s.carry(sb, order)
			return
		}
		if !s.wanted() {
			return
		}
		if s.r.clock().Since(opened) >= maxStandbyRetry {
			retry.reset()
		}
		wait := retry.next()
		s.logEnd(err, wait)
		if !s.pause(wait) {
			return
		}
	}
}

// await opens a standby stream and waits for its order; without one, it
// says why the stream ended.
func (s *standbys) await() (*standby, *tunnelv1.DialOrder, error) {
	// A stream that carries a tunnel outlives the session (detach), as a
	// Tunnel stream opened for an order does, but not the run.
	ctx, cancel := context.WithCancel(s.r.ctx)
	sb := &standby{cancel: cancel, detach: context.AfterFunc(s.ctx, cancel)}
	stream, err := s.r.client.Tunnel(ctx, wire.FrameCallOption())
	if err == nil {
		sb.stream = stream
		err = stream.Send(&tunnelv1.TunnelRequest{Frame: &tunnelv1.TunnelRequest_Open{Open: &tunnelv1.TunnelOpen{StandbyFor: s.regID}}})
	}
	if err != nil {
		sb.release()
		return nil, nil, fmt.Errorf("opening a standby stream: %w", err)
	}
	s.enlist(sb)
	msg, err := stream.Recv()
	s.take(sb)
	if err != nil {
		sb.release()
		return nil, nil, err
	}
	order := msg.GetDialOrder()
	if order == nil {
		sb.release()
		return nil, nil, fmt.Errorf("protocol error: the broker sent %T on a standby stream, want a dial order", msg.GetFrame())
	}
	return sb, order, nil
}

// enlist counts sb among the streams that wait; once the agent drains, it
// closes sb's send direction instead.
func (s *standbys) enlist(sb *standby) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closing {
		sb.closed = true
		_ = sb.stream.CloseSend()
		return
	}
	s.waiting[sb] = struct{}{}
}

// take removes sb from the streams that wait: from then on only its
// goroutine sends on it.
func (s *standbys) take(sb *standby) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.waiting, sb)
}

// replace starts a standby stream in the place of one that got its order.
// The caller is counted in idle, so the count is not zero here.
func (s *standbys) replace() {
	if !s.wanted() {
		return
	}
	s.idle.Add(1)
	go s.keep()
}

// refuse answers an order that came on a standby stream of a draining
// agent as one on the control stream, and ends the stream.
func (s *standbys) refuse(sb *standby, order *tunnelv1.DialOrder) {
	s.control.fail(&tunnelv1.DialFailure{DialId: order.GetDialId(), Code: int32(codes.Unavailable), Message: shuttingDown})
	s.close(sb)
}

// carry serves order, which came on sb: it connects to the target as for
// an order on the control stream, and claims sb for the tunnel with
// open{dial_id}; or it reports why not on the control stream and ends sb.
// The caller has counted the tunnel in (admit).
func (s *standbys) carry(sb *standby, order *tunnelv1.DialOrder) {
	r := s.r
	d := r.newDialed(order, s.control.fail)
	if !r.dialTarget(r.ctx, d, order) {
		s.close(sb)
		r.tunnels.Done()
		return
	}
	// The session may have ended, and cancelled sb, while the agent
	// connected; the broker has failed the dial then.
	if !sb.detach() {
		sb.cancel()
		d.couldNotOpen(errors.New("the registration ended while the agent connected"))
		r.tunnels.Done()
		return
	}
	r.runTunnel(d.claim(sb.stream, sb.cancel, r.stalledWriteTimeout()))
}

// close ends a standby stream that carries no tunnel: it closes its send
// direction and reads the stream to its end, which the broker answers
// with OK. An order that crossed the close (the agent drains) is refused.
// The session's end cancels the stream, if the broker does not end it.
func (s *standbys) close(sb *standby) {
	defer sb.release()
	_ = sb.stream.CloseSend()
	for {
		msg, err := sb.stream.Recv()
		if err != nil {
			if !errors.Is(err, io.EOF) {
				s.log.Debug("standby stream ended", "error", err)
			}
			return
		}
		if order := msg.GetDialOrder(); order != nil {
			s.control.fail(&tunnelv1.DialFailure{DialId: order.GetDialId(), Code: int32(codes.Unavailable), Message: shuttingDown})
		}
	}
}

// logEnd logs why a standby stream ended without an order, and when the
// next opens. The broker ends them when the registration ends or it
// drains, which the control stream tells of too; a refusal, or anything
// else, is worth a line.
func (s *standbys) logEnd(err error, wait time.Duration) {
	level := slog.LevelInfo
	switch {
	case errors.Is(err, io.EOF):
		level, err = slog.LevelDebug, errors.New("the broker ended it")
	case status.Code(err) == codes.Unavailable, status.Code(err) == codes.Canceled:
		level = slog.LevelDebug
	}
	s.log.Log(s.ctx, level, "standby stream ended without an order", "error", err, "retry_in", wait.Round(time.Millisecond).String())
}

// pause waits d, unless the session ends or the agent drains first; it
// reports whether it waited all of d.
func (s *standbys) pause(d time.Duration) bool {
	timer := s.r.clock().NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C():
		return true
	case <-s.ctx.Done():
		return false
	case <-s.r.draining:
		return false
	}
}
