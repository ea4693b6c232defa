package tunnel_test

import (
	"context"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kcp-dev/tunnel-broker/broker/internal/brokertest"
	"github.com/kcp-dev/tunnel-broker/broker/registry"
	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// What a real stream cannot be made to do on cue, tunnels over legs without
// gRPC under them: a Send that blocks until the stream ends, as a gRPC
// stream's does whose peer does not read, and streams that end at a given
// moment of the hand-over.

// leg is one side of a tunnel without gRPC under it. RecvMsg returns the
// frames queued on frames, then blocks until the leg ends; SendMsg blocks
// until the leg ends.
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
		enc, err := proto.Marshal(brokertest.DataUp(p)) // the same bytes on either leg
		if err != nil {
			return err
		}
		return wire.FrameCodec().Unmarshal(mem.BufferSlice{mem.SliceBuffer(enc)}, m)
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

func (l *leg) Recv() (*tunnelv1.DialRequest, error) { panic("not used by a tunnel") }

func (l *leg) Send(*tunnelv1.DialResponse) error { return l.SendMsg(nil) }

// agentLeg is a leg as the agent's Tunnel stream.
type agentLeg struct{ *leg }

func (l agentLeg) Recv() (*tunnelv1.TunnelRequest, error) { panic("not used by a tunnel") }
func (l agentLeg) Send(*tunnelv1.TunnelResponse) error    { return l.SendMsg(nil) }

// legTunnel is a tunnel between two legs, dialed through a registry: the
// agent's Tunnel RPC is a goroutine that runs Open on the agent's leg.
type legTunnel struct {
	t      *testing.T
	agent  *registry.Agent
	tunnel *tunnel.Tunnel
	opened chan error // what Open returns: the status of the agent's RPC
}

// dialLegs dials through a registry with one agent, whose Tunnel RPC opens
// the tunnel on agent.
func dialLegs(t *testing.T, agent *leg) *legTunnel {
	t.Helper()
	r := registry.New(registry.Limits{})
	a := registry.NewAgent("session", brokertest.ID(agentPath), "a", []string{"root"})
	r.Register(a)
	type dialed struct {
		tunnel *tunnel.Tunnel
		err    error
	}
	ctx, cancel := context.WithTimeout(t.Context(), testutil.WaitLong)
	defer cancel()
	got := make(chan dialed, 1)
	go func() {
		tun, err := tunnel.Dial(ctx, r, brokertest.Target("root"), nil)
		got <- dialed{tun, err}
	}()
	lt := &legTunnel{t: t, agent: a, opened: make(chan error, 1)}
	select {
	case order := <-a.Orders():
		go func() { lt.opened <- tunnel.Open(r, order.GetDialId(), a.ID, agentLeg{agent}) }()
	case <-ctx.Done():
		t.Fatal("the agent got no order")
	}
	d := <-got
	if d.err != nil {
		t.Fatalf("dial: %v", d.err)
	}
	lt.tunnel = d.tunnel
	return lt
}

type statuses struct{ caller, agent error }

// splice splices the tunnel with caller in a goroutine, as the Dial RPC does.
func (lt *legTunnel) splice(caller *leg) <-chan statuses {
	done := make(chan statuses, 1)
	go func() {
		c, a := lt.tunnel.Splice(caller, tunnel.Config{}, nil)
		done <- statuses{c, a}
	}()
	return done
}

func TestATunnelEndsWhenTheCallerGoesAwayWhileSendingToTheAgent(t *testing.T) {
	caller, agent := newLeg(t), newLeg(t)
	caller.frames <- []byte("the agent does not read this")
	lt := dialLegs(t, agent)
	done := lt.splice(caller)
	<-agent.sending // blocked in Send to the agent; and receiving from it
	caller.cancel()
	got := testutil.Wait(t, "the splice", done)
	testutil.CheckStatus(t, "caller", got.caller, codes.Canceled, "caller went away")
	testutil.CheckStatus(t, "agent", got.agent, codes.Canceled, "caller went away")
	testutil.CheckStatus(t, "the agent's RPC", testutil.Wait(t, "the agent's RPC", lt.opened), codes.Canceled, "caller went away")
}

func TestATunnelEndsWhenTheAgentGoesAwayWhileSendingToTheCaller(t *testing.T) {
	caller, agent := newLeg(t), newLeg(t)
	agent.frames <- []byte("the caller does not read this")
	lt := dialLegs(t, agent)
	done := lt.splice(caller)
	<-caller.sending
	agent.cancel()
	got := testutil.Wait(t, "the splice", done)
	testutil.CheckStatus(t, "caller", got.caller, codes.Unavailable, "tunnel lost on the agent's side")
	testutil.CheckStatus(t, "agent", got.agent, codes.Aborted, "tunnel aborted")
	testutil.Wait(t, "the agent's RPC", lt.opened)
}

func TestAnAgentWhoseStreamEndsBeforeTheSpliceLosesTheTunnel(t *testing.T) {
	caller, agent := newLeg(t), newLeg(t)
	lt := dialLegs(t, agent)
	agent.cancel()
	// The agent's RPC returns at once, and the splice then finds it gone.
	if err := testutil.Wait(t, "the agent's RPC", lt.opened); err != context.Canceled {
		t.Errorf("the agent's RPC returned %v, want its stream's end", err)
	}
	got := testutil.Wait(t, "the splice", lt.splice(caller))
	testutil.CheckStatus(t, "caller", got.caller, codes.Unavailable, "tunnel lost on the agent's side")
	if n := lt.agent.Tunnels(); n != 0 {
		t.Errorf("the agent carries %d tunnels, want 0", n)
	}
}

// TestASpliceThatBeginsAsTheAgentsStreamEndsEndsBothRPCs races the splice's
// start against the end of the agent's stream: whichever wins, the agent's
// RPC returns only once the tunnel has ended, and the caller learns that the
// agent's side was lost.
func TestASpliceThatBeginsAsTheAgentsStreamEndsEndsBothRPCs(t *testing.T) {
	for i := range 50 {
		caller, agent := newLeg(t), newLeg(t)
		lt := dialLegs(t, agent)
		go agent.cancel()
		got := testutil.Wait(t, "the splice", lt.splice(caller))
		testutil.Wait(t, "the agent's RPC", lt.opened)
		if status.Code(got.caller) != codes.Unavailable {
			t.Errorf("round %d: the caller's status is %v, want Unavailable", i, got.caller)
		}
		if n := lt.agent.Tunnels(); n != 0 {
			t.Fatalf("round %d: the agent carries %d tunnels, want 0", i, n)
		}
	}
}
