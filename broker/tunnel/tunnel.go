// Package tunnel carries one tunneled connection through the broker, from
// the moment its agent claims the dial to the tunnel's end.
//
// A tunnel has two legs (leg.go): the caller's, a Dial stream or a
// connection of the CONNECT front end, and the agent's, a Tunnel stream.
// The agent's RPC claims the dial with Open, hands the tunnel to the dial,
// and waits. The caller's front end gets the tunnel from Dial, tells its
// caller, and calls Splice, which copies each direction in a goroutine of
// its own (splice.go) and waits for the end. Each data frame passes
// through in its wire encoding, without a copy.
//
// A tunnel ends cleanly once both directions have half-closed. Otherwise it
// ends at its first failure: either leg fails or breaks the protocol,
// either peer goes away, the broker stops, or the tunnel carries nothing
// for too long (idle.go). The end ends both legs, each with its status
// (end.go): each RPC from its own handler, which returns the status, and a
// connection by closing it. That frees every copier blocked on either leg,
// whatever the peers do, and the tunnel stops counting against its caller
// and its agent once its copiers are gone. A tunnel that no dial splices
// ends with End.
package tunnel

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"k8s.io/utils/clock"

	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/broker/registry"
	"github.com/kcp-dev/tunnel-broker/internal/splice"
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
	// Caller names who dialed (its SPIFFE ID, or the CONNECT front end's
	// Unix socket), CallerID is its SPIFFE ID if it has one, and
	// Established is when its tunnel was handed to it; all set by the
	// front end before the splice.
	Caller      string
	CallerID    spiffeid.ID
	Established time.Time
	// TraceID is the trace of the tunnel's spans, "" if it has none.
	TraceID string

	claim   *registry.Claim
	agent   *splice.ServerStreamLeg
	endOnce sync.Once

	// The splice (splice.go, end.go, idle.go).
	clock     clock.WithDelayedExecution
	idleLimit time.Duration // <= 0: none
	idleMu    sync.Mutex
	idleTimer clock.Timer  // guarded by idleMu
	lastFrame atomic.Int64 // when a frame last passed, as the clock's UnixNano
	bytesUp   atomic.Int64 // data bytes carried from the caller to the agent
	bytesDown atomic.Int64 // and back
}

// Dial orders an agent that serves target's cluster to connect to it, and
// returns the tunnel that the agent's Tunnel RPC opens for the dial (Open).
// It waits for it until ctx ends; the order gives the agent what is left of
// ctx's deadline, and earlyData, the caller's first bytes if it sent any
// with its target, which the agent writes to the target before anything
// the splice carries. The tunnel must be spliced (Splice) or ended (End).
func Dial(ctx context.Context, r *registry.Registry, target *tunnelv1.Target, earlyData []byte) (*Tunnel, error) {
	claim, err := r.Dial(ctx, target, earlyData)
	if err != nil {
		return nil, err
	}
	// Open hands over nothing but *Tunnel.
	t := claim.Tunnel().(*Tunnel)
	// The early data went up in the order: it counts as the tunnel's
	// first bytes.
	t.bytesUp.Add(int64(len(earlyData)))
	metrics.BytesUp.Add(float64(len(earlyData)))
	return t, nil
}

// Open serves an agent's Tunnel RPC for dial dialID: it claims the dial for
// the agent of SPIFFE ID agentID, hands the tunnel to the dial, and returns
// the status of the agent's RPC once the tunnel has ended. A dial that is
// not pending for that agent is NotFound.
func Open(r *registry.Registry, dialID uint64, agentID spiffeid.ID, stream tunnelv1.AgentService_TunnelServer) error {
	claim, err := r.Claim(dialID, agentID)
	if err != nil {
		return err
	}
	t := &Tunnel{
		ID:     claim.TunnelID,
		Agent:  claim.Agent,
		Target: claim.Target,
		claim:  claim,
		agent:  AgentStream(stream),
	}
	claim.HandOver(t)
	return t.agent.Wait()
}

// End ends the agent's Tunnel RPC with err as its status (nil: OK), and stops
// counting the tunnel against its agent: for a tunnel that no dial will
// splice. Only the first End counts, and none once a splice began.
func (t *Tunnel) End(err error) {
	t.endOnce.Do(func() {
		t.claim.Release()
		t.agent.End(err)
	})
}
