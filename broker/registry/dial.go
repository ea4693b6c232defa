package registry

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/internal/tracing"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// A dial is pending from its order until its agent answers it: with Claim,
// when the agent's Tunnel RPC names it, or with Fail, when the agent reports
// that it could not connect. The dial may also end unanswered: its agent goes
// away, or its context ends.

// pending is a dial waiting for its agent's answer.
type pending struct {
	id     uint64
	agent  *Agent
	target *tunnelv1.Target
	// earlyOrdered: the order carries early data.
	earlyOrdered bool
	answer       chan answer // buffered: the one answer never waits
}

type answer struct {
	claim *Claim
	err   error
}

// A Tunnel is what an agent's Tunnel RPC hands over to the dial it claims:
// package tunnel's Tunnel, which holds the RPC's stream. The registry passes
// it from Claim to Dial without looking into it.
type Tunnel interface {
	// End ends a tunnel that no dial will splice, with err as the status of
	// the agent's Tunnel RPC. The registry ends the tunnel of a dial that
	// gave up as its agent claimed it.
	End(err error)
}

// Claim is a dial its agent has claimed: from now on a tunnel, which counts
// against the agent (Agent.Tunnels) until Release.
type Claim struct {
	// TunnelID names the tunnel in messages and logs: the dial id in hex.
	TunnelID string
	Agent    *Agent
	Target   *tunnelv1.Target

	dial     *pending
	tunnel   Tunnel
	released sync.Once
}

// Dial orders an agent that serves target's cluster to connect to it, and
// waits until the agent claims the dial with the tunnel it opened, reports a
// failure, goes away, or ctx ends. The order gives the agent what is left of
// ctx's deadline, and earlyData (the caller's first bytes, if any), which
// the agent writes to the target before anything the tunnel carries. The
// claim's tunnel must be spliced or ended.
//
// A dial that its agent fails before any byte flows, with Unavailable (its
// target refused, it drains, it went away), is ordered once more, within
// the same deadline, to another agent of the cluster if there is one: HA
// agents stand in for each other. The caller then sees an error only when
// both failed, the second naming the first. A dial whose early data reached
// a target is not ordered again: those bytes may have had an effect.
func (r *Registry) Dial(ctx context.Context, target *tunnelv1.Target, earlyData []byte) (*Claim, error) {
	claim, err := r.dialOnce(ctx, target, earlyData, nil)
	first, ok := errors.AsType[*DialError](err)
	if !ok || status.Code(err) != codes.Unavailable || first.EarlyDataSent || ctx.Err() != nil {
		return claim, err
	}
	claim, err = r.dialOnce(ctx, target, earlyData, first.Agent)
	if err == nil {
		return claim, nil
	}
	second, ok := errors.AsType[*DialError](err)
	if !ok {
		return nil, first // no other agent could take it: one error
	}
	second.Earlier = first
	second.status = renamed(second.status, second.status.Message()+"; before it, "+first.status.Message())
	return nil, second
}

// dialOnce is one attempt of Dial, on an agent other than skip.
func (r *Registry) dialOnce(ctx context.Context, target *tunnelv1.Target, earlyData []byte, skip *Agent) (*Claim, error) {
	p, err := r.newDial(target, len(earlyData) > 0, skip)
	if err != nil {
		return nil, err
	}
	defer r.answered(p)
	order := &tunnelv1.DialOrder{DialId: p.id, Target: target, TimeoutMs: remainingMS(ctx), EarlyData: earlyData,
		TraceContext: tracing.Fields(ctx)}
	select {
	case p.agent.orders <- order:
		trace.SpanFromContext(ctx).AddEvent("order sent", trace.WithAttributes(
			tracing.Agent.String(p.agent.String()), tracing.TunnelID.String(tunnelID(p.id))))
	case <-p.agent.gone:
		return r.giveUp(p, agentGone(p))
	case <-ctx.Done():
		return r.giveUp(p, contextStatus(ctx, p))
	}
	select {
	case a := <-p.answer:
		return a.claim, a.err
	case <-p.agent.gone:
		return r.giveUp(p, agentGone(p))
	case <-ctx.Done():
		return r.giveUp(p, contextStatus(ctx, p))
	}
}

// newDial picks an agent other than skip for target and makes it a pending
// dial, whose order carries early data if earlyOrdered.
func (r *Registry) newDial(target *tunnelv1.Target, earlyOrdered bool, skip *Agent) (*pending, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	a, err := r.pick(target.GetCluster(), skip)
	if err != nil {
		return nil, err
	}
	r.lastID++
	p := &pending{id: r.lastID, agent: a, target: target, earlyOrdered: earlyOrdered, answer: make(chan answer, 1)}
	r.pending[p.id] = p
	a.pending[target.GetCluster()]++
	return p, nil
}

// answered ends p's place among its agent's pending dials for its cluster,
// however it ended.
func (r *Registry) answered(p *pending) {
	r.mu.Lock()
	defer r.mu.Unlock()
	cluster := p.target.GetCluster()
	if p.agent.pending[cluster]--; p.agent.pending[cluster] <= 0 {
		delete(p.agent.pending, cluster)
	}
}

// remainingMS is what is left of ctx's deadline, in milliseconds, for a dial
// order: at least 1, as 0 tells the agent that the broker gave none.
func remainingMS(ctx context.Context) uint32 {
	deadline, ok := ctx.Deadline()
	if !ok {
		return 0
	}
	return uint32(max(time.Until(deadline).Milliseconds(), 1))
}

// giveUp ends a dial that its agent has not answered, with err. If the agent
// claimed it meanwhile, the claim is on its way and nobody will splice its
// tunnel: giveUp ends that tunnel with err.
func (r *Registry) giveUp(p *pending, err error) (*Claim, error) {
	if r.take(p.id, func(q *pending) bool { return q == p }) != nil {
		return nil, err
	}
	if a := <-p.answer; a.claim != nil {
		a.claim.Release()
		a.claim.tunnel.End(err)
	}
	return nil, err
}

// take removes the pending dial id if it is pending and ok says it may be
// taken, and returns it; nil if not.
func (r *Registry) take(id uint64, ok func(*pending) bool) *pending {
	r.mu.Lock()
	defer r.mu.Unlock()
	p := r.pending[id]
	if p == nil || !ok(p) {
		return nil
	}
	delete(r.pending, id)
	return p
}

// Claim takes the pending dial dialID for the agent's Tunnel RPC that names
// it. Only the agent the order went to, by SPIFFE ID, may claim a dial; any
// other claim is NotFound, as is one of a dial that is not pending. The
// tunnel counts against its agent from now on, and HandOver gives it to the
// dial.
func (r *Registry) Claim(dialID uint64, agentID spiffeid.ID) (*Claim, error) {
	p := r.take(dialID, func(p *pending) bool { return p.agent.ID == agentID })
	if p == nil {
		return nil, status.Errorf(codes.NotFound, "no pending dial %d for %s (it timed out or was cancelled)", dialID, agentID)
	}
	p.agent.tunnels.Add(1)
	return &Claim{TunnelID: tunnelID(p.id), Agent: p.agent, Target: p.target, dial: p}, nil
}

// HandOver gives the dial the tunnel its agent opened: Dial returns the claim.
// Call it once, right after Claim.
func (c *Claim) HandOver(t Tunnel) {
	c.tunnel = t
	dial := c.dial
	c.dial = nil // the tunnel, which may last, need not keep its dial
	dial.answer <- answer{claim: c}
}

// Tunnel is what the agent's Tunnel RPC handed over.
func (c *Claim) Tunnel() Tunnel { return c.tunnel }

// Release stops counting the tunnel against its agent, once its end is
// known. Only the first call counts.
func (c *Claim) Release() {
	c.released.Do(func() { c.Agent.tunnels.Add(-1) })
}

// Fail answers a pending dial with its agent's failure. A failure of a dial
// that is not pending, or that was ordered on another of the agent's control
// streams, is ignored.
func (r *Registry) Fail(a *Agent, f *tunnelv1.DialFailure) {
	if p := r.take(f.GetDialId(), func(p *pending) bool { return p.agent == a }); p != nil {
		p.answer <- answer{err: agentFailure(p, f)}
	}
}
