// Package tunnel carries one tunneled connection through the broker, from the
// moment its agent claims the dial to the tunnel's end.
//
// A tunnel is two gRPC streams, each served by its own RPC handler: the
// caller's Dial stream and the agent's Tunnel stream. Either may instead be
// a connection dressed as a stream: a dial connection's leg for the caller
// or a data connection's for the agent (connleg.go), which carry one
// tunnel after another in frames, or the CONNECT front end's client, which
// carries one tunnel's bytes as they are (conn.go). The agent's handler
// claims the dial with Open and waits. The dial's handler gets the tunnel
// from Dial, tells its caller, and calls Splice, which copies each direction
// in one of the two handlers: the dial's handler copies up, from the caller
// to the agent, and the agent's handler copies down, from the agent to the
// caller (splice.go). That is two goroutines a tunnel, the least two gRPC
// streams allow, and each data frame passes through in its wire encoding,
// without a copy.
//
// A tunnel ends cleanly once both directions have half-closed. Otherwise it
// ends at its first failure: either leg fails or breaks the protocol, either
// stream ends, the broker stops, or the tunnel carries nothing for too long
// (idle.go). The first failure ends both RPCs at once, each with its status
// (end.go), so that a handler blocked on a silent peer is freed too. A
// tunnel that no dial splices ends with End.
package tunnel

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"k8s.io/utils/clock"

	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/broker/registry"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// Tunnel is one tunneled connection, from its agent's claim to its end.
type Tunnel struct {
	// ID names the tunnel in logs and in the caller's Established: its dial
	// id in hex.
	ID string
	// Agent is the agent whose Tunnel RPC carries it.
	Agent *registry.Agent
	// Target is what the dial named.
	Target *tunnelv1.Target
	// Caller is the SPIFFE ID that dialed, and Established when its tunnel
	// was handed to it; both set by the Dial RPC before the splice.
	Caller      spiffeid.ID
	Established time.Time

	claim  *registry.Claim
	agent  grpc.ServerStream // a Tunnel stream, or a data connection's leg (OpenConn)
	caller grpc.ServerStream // set by Splice: a Dial stream, a dial connection's leg, or a connection (SpliceConn)
	// earlyData is the caller's early data that its agent's order did not
	// carry: the splice sends it to the agent first.
	earlyData []byte

	// The hand-over from the Dial RPC to the agent's Tunnel RPC.
	mu          sync.Mutex
	spliced     bool          // a splice has begun: the agent's RPC copies down
	agentLeft   bool          // the agent's RPC returned first: no splice may begin
	splicing    chan struct{} // closed when a splice begins
	ended       chan struct{} // closed by End: the agent's RPC returns agentStatus
	endOnce     sync.Once
	agentStatus error

	// The splice (splice.go, end.go, idle.go).
	clock      clock.WithDelayedExecution
	idleLimit  time.Duration // <= 0: none
	idleTimer  clock.Timer   // guarded by endMu
	lastFrame  atomic.Int64  // when a frame last passed, as the clock's UnixNano
	bytesUp    atomic.Int64  // data bytes carried from the caller to the agent
	bytesDown  atomic.Int64  // and back
	downDone   chan struct{} // closed when the down direction has stopped
	onEnd      func()        // runs once, as soon as the end is known
	endMu      sync.Mutex
	endDecided bool     // the end is known: a later failure changes nothing
	failure    *failure // the first failure; nil for a clean end
}

// Dial orders an agent that serves target's cluster to connect to it, and
// returns the tunnel that the agent's Tunnel RPC opens for the dial (Open).
// It waits for it until ctx ends; the order gives the agent what is left of
// ctx's deadline. earlyData, the caller's first bytes if it sent any with
// its target, reach the target before anything the splice carries: in the
// order, for an agent that accepts early data, or else as the first frame
// of the splice. The tunnel must be spliced (Splice) or ended (End).
func Dial(ctx context.Context, r *registry.Registry, target *tunnelv1.Target, earlyData []byte) (*Tunnel, error) {
	claim, err := r.Dial(ctx, target, earlyData)
	if err != nil {
		return nil, err
	}
	// Open hands over nothing but *Tunnel.
	t := claim.Tunnel().(*Tunnel)
	if len(earlyData) > 0 && !claim.EarlyDataOrdered {
		t.earlyData = earlyData
	}
	return t, nil
}

// Open serves an agent's Tunnel RPC for dial dialID: it claims the dial for
// the agent of SPIFFE ID agentID, hands the tunnel to the dial, copies down
// once the dial splices it, and returns the status of the agent's RPC once
// the tunnel has ended. A dial that is not pending for that agent is
// NotFound.
func Open(r *registry.Registry, dialID uint64, agentID spiffeid.ID, stream tunnelv1.AgentService_TunnelServer) error {
	claim, err := r.Claim(dialID, agentID)
	if err != nil {
		return err
	}
	return open(claim, stream)
}

// OpenConn is Open for a dial that its agent answered OK on a data
// connection (docs/protocol.md §3.5): leg is the agent's leg until the
// tunnel ends. A dial that is no longer pending (it gave up as the agent
// answered) is NotFound, and leg carries no tunnel: its Finish ends the
// agent's side with that status. The end exchange is leg.Finish's.
func OpenConn(r *registry.Registry, dialID uint64, agentID spiffeid.ID, leg *ConnLeg) error {
	claim, err := r.Claim(dialID, agentID)
	if err != nil {
		return err
	}
	return open(claim, leg)
}

// open hands the claimed dial's tunnel, whose agent's leg is agent, to the
// dial, and serves that leg until the tunnel ends.
func open(claim *registry.Claim, agent grpc.ServerStream) error {
	t := &Tunnel{
		ID:       claim.TunnelID,
		Agent:    claim.Agent,
		Target:   claim.Target,
		claim:    claim,
		agent:    agent,
		splicing: make(chan struct{}),
		ended:    make(chan struct{}),
	}
	claim.HandOver(t)
	return t.serveAgent()
}

// serveAgent is the agent's Tunnel RPC once it has handed the tunnel over: it
// copies down once the splice begins, and returns when the tunnel has ended.
// If its stream ends before a splice begins, it returns at once, and no
// splice will begin.
func (t *Tunnel) serveAgent() error {
	ctx := t.agent.Context()
	select {
	case <-t.splicing:
	case <-t.ended:
		return t.agentStatus
	case <-ctx.Done():
		t.mu.Lock()
		t.agentLeft = !t.spliced
		t.mu.Unlock()
		if t.agentLeft {
			return ctx.Err()
		}
		// The splice began meanwhile, and its down direction needs this
		// goroutine: it stops at once on the ended stream.
	}
	t.copyDown()
	<-t.ended
	return t.agentStatus
}

// beginSplice lets the agent's RPC copy down; false if that RPC has returned.
func (t *Tunnel) beginSplice() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.agentLeft {
		return false
	}
	t.spliced = true
	close(t.splicing)
	return true
}

// End ends the agent's Tunnel RPC with err as its status (nil: OK), and stops
// counting the tunnel against its agent. Only the first End counts. A splice
// ends its tunnel itself; End is for a tunnel that no dial will splice.
func (t *Tunnel) End(err error) {
	t.endOnce.Do(func() {
		t.claim.Release()
		t.agentStatus = err
		close(t.ended)
	})
}

// DialCounted is Dial for a front end (the Dial RPC, the CONNECT front
// end): it counts the dial in the dial metrics, and the limit that refused
// it if one did, and returns how long it took and, for a failure, what to
// log it with.
func DialCounted(ctx context.Context, r *registry.Registry, target *tunnelv1.Target, earlyData []byte) (t *Tunnel, took time.Duration, logAttrs []any, err error) {
	start := time.Now()
	t, err = Dial(ctx, r, target, earlyData)
	took = time.Since(start)
	code := status.Code(err)
	metrics.Dials.WithLabelValues(code.String()).Inc()
	metrics.DialSeconds.WithLabelValues(code.String()).Observe(took.Seconds())
	if err == nil {
		return t, took, nil, nil
	}
	if limit, ok := errors.AsType[*registry.LimitError](err); ok {
		metrics.LimitsHit.WithLabelValues(limit.Limit).Inc()
	}
	if failed, ok := errors.AsType[*registry.DialError](err); ok {
		logAttrs = failed.LogAttrs()
	}
	return nil, took, append(logAttrs, "code", code.String(), "error", status.Convert(err).Message(), "took", took), err
}
