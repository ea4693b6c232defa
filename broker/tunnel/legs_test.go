package tunnel_test

import (
	"context"
	"errors"
	"io"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kcp-dev/tunnel-broker/broker/internal/brokertest"
	"github.com/kcp-dev/tunnel-broker/broker/registry"
	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// What a real stream cannot be made to do on cue, tunnels over streams
// without gRPC under them: a Send that blocks until the stream ends, as a
// gRPC stream's does whose peer does not read, and streams that end at a
// given moment of the hand-over. As in gRPC, a stream ends when its peer
// goes away or its handler returns, and not otherwise.

// stream is one side of a tunnel without gRPC under it. RecvMsg returns the
// frames queued on frames, then blocks until the stream ends; SendMsg
// blocks until the stream ends.
type stream struct {
	grpc.ServerStream // not used: calling any other method panics
	ctx               context.Context
	end               context.CancelFunc // the peer goes away, or the handler returns
	frames            chan []byte
	sending           chan struct{} // gets a value as each SendMsg blocks
}

func newStream(t *testing.T) *stream {
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	return &stream{ctx: ctx, end: cancel, frames: make(chan []byte, 1), sending: make(chan struct{}, 1)}
}

func (s *stream) Context() context.Context { return s.ctx }

func (s *stream) RecvMsg(m any) error {
	select {
	case p := <-s.frames:
		enc, err := proto.Marshal(brokertest.DataUp(p)) // the same bytes on either leg
		if err != nil {
			return err
		}
		return wire.FrameCodec().Unmarshal(mem.BufferSlice{mem.SliceBuffer(enc)}, m)
	case <-s.ctx.Done():
		return status.FromContextError(s.ctx.Err()).Err()
	}
}

func (s *stream) SendMsg(any) error {
	select {
	case s.sending <- struct{}{}:
	default:
	}
	<-s.ctx.Done()
	return status.FromContextError(s.ctx.Err()).Err()
}

func (s *stream) Recv() (*tunnelv1.TunnelRequest, error) { panic("not used by a tunnel") }
func (s *stream) Send(*tunnelv1.TunnelResponse) error    { return s.SendMsg(nil) }

// halfClosed is a stream whose peer has half-closed: RecvMsg returns
// io.EOF, and SendMsg blocks until the stream ends, as a peer's that
// reads no more.
type halfClosed struct{ *stream }

func (s halfClosed) RecvMsg(any) error { return io.EOF }

// legTunnel is a tunnel between two streams, dialed through a registry: the
// agent's Tunnel RPC is a goroutine that runs Open on the agent's stream,
// and ends it when Open returns.
type legTunnel struct {
	t      *testing.T
	agent  *registry.Agent
	tunnel *tunnel.Tunnel
	opened chan error // what Open returns: the status of the agent's RPC
}

// dialLegs dials through a registry with one agent, whose Tunnel RPC opens
// the tunnel on agent.
func dialLegs(t *testing.T, agent grpc.ServerStream, end func()) *legTunnel {
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
		go func() {
			err := tunnel.Open(r, order.GetDialId(), a.ID, agent.(tunnelv1.AgentService_TunnelServer))
			end() // the handler returned: its stream ends
			lt.opened <- err
		}()
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

// splice splices the tunnel with caller in a goroutine, as the Dial RPC
// does, and ends caller's stream when it returns. released is closed once
// the tunnel stops counting: its copiers are gone.
func (lt *legTunnel) splice(caller grpc.ServerStream, end func()) (done <-chan statuses, released <-chan struct{}) {
	spliced := make(chan statuses, 1)
	gone := make(chan struct{})
	go func() {
		c, a := lt.tunnel.Splice(tunnel.CallerStream(caller), tunnel.Config{}, func() { close(gone) })
		end()
		spliced <- statuses{c, a}
	}()
	return spliced, gone
}

func TestATunnelEndsWhenTheCallerGoesAwayWhileSendingToTheAgent(t *testing.T) {
	caller, agent := newStream(t), newStream(t)
	caller.frames <- []byte("the agent does not read this")
	lt := dialLegs(t, agent, agent.end)
	done, released := lt.splice(caller, caller.end)
	<-agent.sending // blocked in Send to the agent; and receiving from it
	caller.end()
	got := testutil.Wait(t, "the splice", done)
	testutil.CheckStatus(t, "caller", got.caller, codes.Canceled, "caller went away")
	testutil.CheckStatus(t, "agent", got.agent, codes.Canceled, "caller went away")
	testutil.CheckStatus(t, "the agent's RPC", testutil.Wait(t, "the agent's RPC", lt.opened), codes.Canceled, "caller went away")
	testutil.Wait(t, "the tunnel's copiers to return", released)
}

func TestATunnelEndsWhenTheAgentGoesAwayWhileSendingToTheCaller(t *testing.T) {
	caller, agent := newStream(t), newStream(t)
	agent.frames <- []byte("the caller does not read this")
	lt := dialLegs(t, agent, agent.end)
	done, released := lt.splice(caller, caller.end)
	<-caller.sending
	agent.end()
	got := testutil.Wait(t, "the splice", done)
	testutil.CheckStatus(t, "caller", got.caller, codes.Unavailable, "tunnel lost on the agent's side")
	testutil.CheckStatus(t, "agent", got.agent, codes.Aborted, "tunnel aborted")
	testutil.Wait(t, "the agent's RPC", lt.opened)
	testutil.Wait(t, "the tunnel's copiers to return", released)
}

// A caller that half-closes and then reads nothing, while the agent sends:
// the down direction blocks in a Send to the caller that nothing but the
// end of the caller's stream frees. When the agent goes away, the tunnel
// ends both legs, the caller's handler returns, and every copier returns:
// nothing of the tunnel stays pinned, and only then does it stop counting
// against its caller and its agent.
func TestACallerThatHalfClosesAndStopsReadingPinsNothingOnceTheTunnelEnds(t *testing.T) {
	caller, agent := newStream(t), newStream(t)
	agent.frames <- []byte("the caller does not read this")
	lt := dialLegs(t, agent, agent.end)
	done, released := lt.splice(halfClosed{caller}, caller.end)
	<-caller.sending // the down copier is blocked sending to the caller
	select {
	case <-released:
		t.Fatal("the tunnel stopped counting while its down copier runs")
	default:
	}
	if n := lt.agent.Tunnels(); n != 1 {
		t.Fatalf("the agent carries %d tunnels, want 1", n)
	}
	agent.end()
	got := testutil.Wait(t, "the splice", done)
	testutil.CheckStatus(t, "caller", got.caller, codes.Unavailable, "tunnel lost on the agent's side")
	testutil.Wait(t, "the agent's RPC", lt.opened)
	testutil.Wait(t, "the tunnel's copiers to return", released)
	if n := lt.agent.Tunnels(); n != 0 {
		t.Errorf("the agent carries %d tunnels after the end, want 0", n)
	}
}

func TestAnAgentWhoseStreamEndsBeforeTheSpliceLosesTheTunnel(t *testing.T) {
	caller, agent := newStream(t), newStream(t)
	lt := dialLegs(t, agent, agent.end)
	agent.end()
	// The agent's RPC returns at once, and the splice then finds it gone.
	if err := testutil.Wait(t, "the agent's RPC", lt.opened); !errors.Is(err, context.Canceled) {
		t.Errorf("the agent's RPC returned %v, want its stream's end", err)
	}
	done, released := lt.splice(caller, caller.end)
	got := testutil.Wait(t, "the splice", done)
	testutil.CheckStatus(t, "caller", got.caller, codes.Unavailable, "tunnel lost on the agent's side")
	testutil.Wait(t, "the tunnel's copiers to return", released)
	if n := lt.agent.Tunnels(); n != 0 {
		t.Errorf("the agent carries %d tunnels, want 0", n)
	}
}

// TestASpliceThatBeginsAsTheAgentsStreamEndsEndsBothRPCs races the splice's
// start against the end of the agent's stream: whichever wins, the agent's
// RPC returns, and the caller learns that the agent's side was lost.
func TestASpliceThatBeginsAsTheAgentsStreamEndsEndsBothRPCs(t *testing.T) {
	for i := range 50 {
		caller, agent := newStream(t), newStream(t)
		lt := dialLegs(t, agent, agent.end)
		go agent.end()
		done, released := lt.splice(caller, caller.end)
		got := testutil.Wait(t, "the splice", done)
		testutil.Wait(t, "the agent's RPC", lt.opened)
		testutil.Wait(t, "the tunnel's copiers to return", released)
		if status.Code(got.caller) != codes.Unavailable {
			t.Errorf("round %d: the caller's status is %v, want Unavailable", i, got.caller)
		}
		if n := lt.agent.Tunnels(); n != 0 {
			t.Fatalf("round %d: the agent carries %d tunnels, want 0", i, n)
		}
	}
}
