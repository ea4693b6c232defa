package registry

import (
	"context"
	"sync"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// Tunnel is an agent's data stream for one dial, handed from the agent's
// Tunnel RPC to the caller's Dial RPC, which splices it. The splice hands
// back the half that the Tunnel RPC's own goroutine runs (Start, Wait).
type Tunnel struct {
	ID     string
	Agent  *Agent
	Target *tunnelv1.Target
	Stream tunnelv1.AgentService_TunnelServer

	mu      sync.Mutex
	half    func()
	started chan struct{} // closed once half is set
	gone    bool          // the Tunnel RPC ended before Start

	done     chan struct{}
	once     sync.Once
	released sync.Once
	err      error
}

func newTunnel(p *Pending, stream tunnelv1.AgentService_TunnelServer) *Tunnel {
	p.Agent.tunnels.Add(1)
	return &Tunnel{
		ID:      tunnelID(p.ID),
		Agent:   p.Agent,
		Target:  p.Target,
		Stream:  stream,
		started: make(chan struct{}),
		done:    make(chan struct{}),
	}
}

// Finish ends the agent's Tunnel RPC with err (nil for a clean end), and
// Releases the tunnel. Only the first call counts.
func (t *Tunnel) Finish(err error) {
	t.once.Do(func() {
		t.err = err
		t.Release()
		close(t.done)
	})
}

// Release stops counting the tunnel against its agent (Agent.Tunnels) before
// Finish, once its end is known. Only the first call counts.
func (t *Tunnel) Release() {
	t.released.Do(func() { t.Agent.tunnels.Add(-1) })
}

// Start hands half to the agent's Tunnel RPC, which runs it in its own
// goroutine, then waits for Finish. It reports false, and half does not run,
// if that RPC has already ended.
func (t *Tunnel) Start(half func()) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.gone {
		return false
	}
	t.half = half
	close(t.started)
	return true
}

// Wait serves the agent's Tunnel RPC: it runs the half the splice hands it,
// then blocks until the splice finishes the tunnel. If the agent's stream
// ends before the splice starts, it returns at once.
func (t *Tunnel) Wait(ctx context.Context) error {
	select {
	case <-t.started:
	case <-t.done:
		return t.err
	case <-ctx.Done():
		t.mu.Lock()
		started := t.half != nil
		t.gone = !started
		t.mu.Unlock()
		if !started {
			return ctx.Err()
		}
	}
	t.half()
	<-t.done
	return t.err
}
