package registry

import (
	"context"
	"fmt"
	"sync"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// Tunnel is an agent's data stream for one dial, handed from the agent's
// Tunnel RPC to the caller's Dial RPC, which splices it.
type Tunnel struct {
	ID     string
	Agent  *Agent
	Target *tunnelv1.Target
	Stream tunnelv1.AgentService_TunnelServer

	done chan struct{}
	once sync.Once
	err  error
}

func newTunnel(p *Pending, stream tunnelv1.AgentService_TunnelServer) *Tunnel {
	p.Agent.tunnels.Add(1)
	return &Tunnel{
		ID:     fmt.Sprintf("%016x", p.ID),
		Agent:  p.Agent,
		Target: p.Target,
		Stream: stream,
		done:   make(chan struct{}),
	}
}

// Finish ends the agent's Tunnel RPC with err (nil for a clean end). Only the
// first call counts.
func (t *Tunnel) Finish(err error) {
	t.once.Do(func() {
		t.err = err
		t.Agent.tunnels.Add(-1)
		close(t.done)
	})
}

// Wait blocks the agent's Tunnel RPC until the splice finishes it, or the
// agent's stream ends first.
func (t *Tunnel) Wait(ctx context.Context) error {
	select {
	case <-t.done:
		return t.err
	case <-ctx.Done():
		return ctx.Err()
	}
}
