package dial

import (
	"bytes"
	"context"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"k8s.io/utils/clock"

	"github.com/kcp-dev/tunnel-broker/broker/internal/brokertest"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

func TestTunnelCarriesBytesBothWays(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, "a", "root")
	tn := a.establish(t, brokertest.Target("root"))

	tn.up("ping")
	tn.down("pong")
	// Frames as large as the agent and kcpplugin send, each passed on whole
	// and in order.
	for i := range 8 {
		frame := bytes.Repeat([]byte{byte('a' + i)}, 32<<10-16)
		tn.up(string(frame))
		tn.down(string(frame))
	}
	tn.closeBoth()
	if n := b.Registry.Agents()[0].Tunnels(); n != 0 {
		t.Errorf("the agent carries %d tunnels after the end, want 0", n)
	}
	if n := b.dial.Active(); n != 0 {
		t.Errorf("%d tunnels active after the end, want 0", n)
	}
}

func TestTunnelHalfClosesEachWayAlone(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, "a", "root")

	t.Run("caller first", func(t *testing.T) {
		tn := a.establish(t, brokertest.Target("root"))
		tn.closeWriteUp()
		// The other direction still carries data.
		tn.down("after the caller's half-close")
		tn.down("and more")
		tn.closeWriteDown()
		if err := tn.callerEnd(); err != nil {
			t.Errorf("caller's status: %v, want OK", err)
		}
		if err := tn.agentEnd(); err != nil {
			t.Errorf("agent's status: %v, want OK", err)
		}
	})
	t.Run("agent first", func(t *testing.T) {
		tn := a.establish(t, brokertest.Target("root"))
		tn.closeWriteDown()
		tn.up("after the agent's half-close")
		tn.up("and more")
		tn.closeWriteUp()
		if err := tn.agentEnd(); err != nil {
			t.Errorf("agent's status: %v, want OK", err)
		}
		if err := tn.callerEnd(); err != nil {
			t.Errorf("caller's status: %v, want OK", err)
		}
	})
}

func TestTunnelLostOnTheAgentsSideIsUnavailableToTheCaller(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, "a", "root")

	t.Run("agent cancels", func(t *testing.T) {
		tn := a.establish(t, brokertest.Target("root"))
		tn.up("x")
		tn.cancelAgent()
		brokertest.CheckStatus(t, "caller", tn.callerEnd(), codes.Unavailable, "tunnel lost on the agent's side")
		if n := b.Registry.Agents()[0].Tunnels(); n != 0 {
			t.Errorf("the agent carries %d tunnels after the end, want 0", n)
		}
	})
	t.Run("agent breaks the protocol", func(t *testing.T) {
		tn := a.establish(t, brokertest.Target("root"))
		again := &tunnelv1.TunnelRequest{Frame: &tunnelv1.TunnelRequest_Open{Open: &tunnelv1.TunnelOpen{DialId: 1}}}
		if err := tn.agent.Send(again); err != nil {
			t.Fatal(err)
		}
		brokertest.CheckStatus(t, "caller", tn.callerEnd(), codes.Unavailable, "protocol error: after opening, an agent may only send non-empty data")
		brokertest.CheckStatus(t, "agent", tn.agentEnd(), codes.Aborted, "tunnel aborted: protocol error")
	})
}

func TestCallerGoingAwayEndsTheAgentsTunnel(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, "a", "root")
	tn := a.establish(t, brokertest.Target("root"))
	tn.down("x")
	tn.cancelCaller()
	brokertest.CheckStatus(t, "agent", tn.agentEnd(), codes.Canceled, "caller went away")
}

func TestCallerBreakingTheProtocolAfterTheTarget(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, "a", "root")
	for _, tc := range []struct {
		name string
		msg  *tunnelv1.DialRequest
	}{
		{"a second target", &tunnelv1.DialRequest{Frame: &tunnelv1.DialRequest_Target{Target: brokertest.Target("root")}}},
		{"empty data", dataUp([]byte{})},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tn := a.establish(t, brokertest.Target("root"))
			tn.up("fine so far")
			if err := tn.caller.Send(tc.msg); err != nil {
				t.Fatal(err)
			}
			brokertest.CheckStatus(t, "caller", tn.callerEnd(), codes.InvalidArgument, "protocol error: after the target, a caller may only send non-empty data")
			brokertest.CheckStatus(t, "agent", tn.agentEnd(), codes.Canceled, "caller broke the protocol")
		})
	}
}

func TestIdleTunnelEndsWithDeadlineExceededOnBothLegs(t *testing.T) {
	const idle = 10 * time.Minute
	clk := brokertest.NewClock()
	b := startBroker(t, config{idleTimeout: idle, clock: &clk})
	a := b.connectAgent(t, "a", "root")
	tn := a.establish(t, brokertest.Target("root"))
	tn.up("x")
	tn.down("y")
	// Then nothing: the broker ends it.
	clk.Step(idle)
	brokertest.CheckStatus(t, "caller", tn.callerEnd(), codes.DeadlineExceeded, "tunnel carried nothing for 10m0s")
	brokertest.CheckStatus(t, "agent", tn.agentEnd(), codes.DeadlineExceeded, "tunnel carried nothing for 10m0s")
}

func TestATunnelThatCarriesDataIsNotIdle(t *testing.T) {
	const idle = 10 * time.Minute
	clk := brokertest.NewClock()
	b := startBroker(t, config{idleTimeout: idle, clock: &clk})
	a := b.connectAgent(t, "a", "root")
	tn := a.establish(t, brokertest.Target("root"))
	clk.Step(idle / 2)
	tn.up("halfway")
	// The idle timer fires, finds the tunnel quiet for half the limit, and
	// waits for the other half.
	clk.Step(idle / 2)
	clk.WaitForTimers(t, 1)
	tn.down("still open")
	clk.Step(idle)
	brokertest.CheckStatus(t, "caller", tn.callerEnd(), codes.DeadlineExceeded, "tunnel carried nothing for 10m0s")
}

func TestStoppingEndsTunnelsWithUnavailable(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, "a", "root")
	tn := a.establish(t, brokertest.Target("root"))
	tn.up("x")
	b.Drain()
	// Draining alone leaves tunnels in flight alone.
	tn.down("still flowing while draining")
	b.Stop()
	brokertest.CheckStatus(t, "caller", tn.callerEnd(), codes.Unavailable, "the broker is shutting down and its grace period is over")
	brokertest.CheckStatus(t, "agent", tn.agentEnd(), codes.Unavailable, "the broker is shutting down")
}

// leg is one side of a splice without gRPC under it, for what a real stream
// cannot be made to do on cue: block in Send until its own context ends, as
// a gRPC stream does whose peer does not read. RecvMsg returns the frames
// queued on frames, then blocks likewise.
type leg struct {
	grpc.ServerStream // not used: calling any other method panics
	ctx               context.Context
	cancel            context.CancelFunc
	frames            chan []byte
	sending           chan struct{} // gets a value as each SendMsg blocks
}

func newLeg(t *testing.T) *leg {
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	l := &leg{cancel: cancel, frames: make(chan []byte, 1), sending: make(chan struct{}, 1)}
	// As in gRPC, writing the status ends the stream.
	l.ctx = grpc.NewContextWithServerTransportStream(ctx, legTransport{l})
	return l
}

// legTransport is the part of a gRPC stream that ends it with a status.
type legTransport struct{ *leg }

func (legTransport) Method() string                     { return "/leg" }
func (legTransport) SetHeader(metadata.MD) error        { return nil }
func (legTransport) SendHeader(metadata.MD) error       { return nil }
func (legTransport) SetTrailer(metadata.MD) error       { return nil }
func (l legTransport) WriteStatus(*status.Status) error { l.cancel(); return nil }

func (l *leg) Context() context.Context { return l.ctx }

func (l *leg) RecvMsg(m any) error {
	select {
	case p := <-l.frames:
		enc, err := proto.Marshal(dataUp(p)) // the same bytes on either leg
		if err != nil {
			return err
		}
		return tunnelv1.FrameCodec().Unmarshal(mem.BufferSlice{mem.SliceBuffer(enc)}, m)
	case <-l.ctx.Done():
		return status.FromContextError(l.ctx.Err()).Err()
	}
}

func (l *leg) SendMsg(any) error {
	select {
	case l.sending <- struct{}{}:
	default:
	}
	<-l.ctx.Done()
	return status.FromContextError(l.ctx.Err()).Err()
}

func (l *leg) Recv() (*tunnelv1.DialRequest, error) { panic("not used by splice") }

func (l *leg) Send(*tunnelv1.DialResponse) error { return l.SendMsg(nil) }

// agentLeg is a leg as the agent's Tunnel stream.
type agentLeg struct{ *leg }

func (l agentLeg) Recv() (*tunnelv1.TunnelRequest, error) { panic("not used by splice") }
func (l agentLeg) Send(*tunnelv1.TunnelResponse) error    { return l.SendMsg(nil) }

type statuses struct{ caller, agent error }

// startSplice splices caller and agent as the Dial handler does, with the
// down copy in a goroutine of its own as the agent's Tunnel handler would.
func startSplice(t *testing.T, caller *leg, agent *leg) <-chan statuses {
	stopping, stop := context.WithCancel(context.Background())
	t.Cleanup(stop)
	done := make(chan statuses, 1)
	go func() {
		sp := &splice{caller: caller, agent: agentLeg{agent}, clock: clock.RealClock{}}
		c, a := sp.run(func(down func()) bool { go down(); return true }, stopping)
		done <- statuses{c, a}
	}()
	return done
}

func waitSplice(t *testing.T, done <-chan statuses) statuses {
	t.Helper()
	select {
	case s := <-done:
		return s
	case <-time.After(brokertest.WaitLong):
		t.Fatal("the splice did not end")
		return statuses{}
	}
}

func TestSpliceEndsWhenTheCallerGoesAwayWhileSendingToTheAgent(t *testing.T) {
	caller, agent := newLeg(t), newLeg(t)
	caller.frames <- []byte("the agent does not read this")
	done := startSplice(t, caller, agent)
	<-agent.sending // blocked in Send to the agent; and receiving from it
	caller.cancel()
	got := waitSplice(t, done)
	brokertest.CheckStatus(t, "caller", got.caller, codes.Canceled, "caller went away")
	brokertest.CheckStatus(t, "agent", got.agent, codes.Canceled, "caller went away")
	agent.cancel() // as the agent's handler does once the tunnel is finished
}

func TestSpliceEndsWhenTheAgentGoesAwayWhileSendingToTheCaller(t *testing.T) {
	caller, agent := newLeg(t), newLeg(t)
	agent.frames <- []byte("the caller does not read this")
	done := startSplice(t, caller, agent)
	<-caller.sending
	agent.cancel()
	got := waitSplice(t, done)
	brokertest.CheckStatus(t, "caller", got.caller, codes.Unavailable, "tunnel lost on the agent's side")
	brokertest.CheckStatus(t, "agent", got.agent, codes.Aborted, "tunnel aborted")
	caller.cancel()
}
