package agent

import (
	"log/slog"
	"sync"
	"time"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// controlStream is the agent's side of a registered Connect stream. The
// session's loop, its tunnels and its announcer all send on it, and a gRPC
// stream takes one sender at a time.
type controlStream struct {
	stream tunnelv1.AgentService_ConnectClient
	mu     sync.Mutex
	grace  time.Duration // sent with the drain
	log    *slog.Logger
	// drainSent makes the drain go out once, before the send direction
	// closes, however the agent's stop and the announcer race.
	drainSent sync.Once
}

func (r *agentRun) newControlStream(stream tunnelv1.AgentService_ConnectClient) *controlStream {
	return &controlStream{stream: stream, grace: r.grace(), log: r.Log.With("broker", r.Broker)}
}

// send sends m; an error shows in the session's Recv.
func (c *controlStream) send(m *tunnelv1.ConnectRequest) {
	c.mu.Lock()
	defer c.mu.Unlock()
	_ = c.stream.Send(m)
}

// fail tells the broker that a dial failed.
func (c *controlStream) fail(f *tunnelv1.DialFailure) {
	c.send(&tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_DialFailure{DialFailure: f}})
}

// drain asks the broker to route the agent no new dials.
func (c *controlStream) drain() {
	c.drainSent.Do(func() {
		c.log.Info("draining", "grace", c.grace)
		c.send(&tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Drain{Drain: &tunnelv1.Drain{GraceMs: uint32(c.grace.Milliseconds())}}})
	})
}

// closeSend ends the registration: the broker answers by ending the stream.
func (c *controlStream) closeSend() {
	c.mu.Lock()
	defer c.mu.Unlock()
	_ = c.stream.CloseSend()
}

// ClustersPerRegister is how many clusters one Register message names: at
// most about 18 KiB of names, well within the broker's largest message
// (32 KiB by default). A longer list goes in several messages.
const ClustersPerRegister = 256

// registers are the Register messages that state clusters: all but the last
// set more, and the broker puts the set in force with the last.
func registers(clusters []string, name string) []*tunnelv1.ConnectRequest {
	var out []*tunnelv1.ConnectRequest
	for {
		n := min(len(clusters), ClustersPerRegister)
		out = append(out, &tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Register{Register: &tunnelv1.Register{
			Clusters: clusters[:n], AgentName: name, More: n < len(clusters),
		}}})
		if clusters = clusters[n:]; len(clusters) == 0 {
			return out
		}
	}
}
