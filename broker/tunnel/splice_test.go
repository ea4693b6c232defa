package tunnel_test

import (
	"bytes"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/kcp-dev/tunnel-broker/broker/internal/brokertest"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// A tunnel through the broker's services, played by hand on both sides:
// what it carries, and how it ends.

func TestTunnelCarriesBytesBothWays(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, "a", "root")
	tn := a.Establish(t, kcpPath, brokertest.Target("root"))

	tn.Up("ping")
	tn.Down("pong")
	// Frames as large as the agent and kcpplugin send, each passed on whole
	// and in order.
	for i := range 8 {
		frame := bytes.Repeat([]byte{byte('a' + i)}, 32<<10-16)
		tn.Up(string(frame))
		tn.Down(string(frame))
	}
	tn.CloseBoth()
	if n := b.Registry.Agents()[0].Tunnels(); n != 0 {
		t.Errorf("the agent carries %d tunnels after the end, want 0", n)
	}
	if n := b.admission.Active(); n != 0 {
		t.Errorf("%d tunnels active after the end, want 0", n)
	}
}

func TestTunnelHalfClosesEachWayAlone(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, "a", "root")

	t.Run("caller first", func(t *testing.T) {
		tn := a.Establish(t, kcpPath, brokertest.Target("root"))
		tn.CloseWriteUp()
		// The other direction still carries data.
		tn.Down("after the caller's half-close")
		tn.Down("and more")
		tn.CloseWriteDown()
		if err := tn.CallerEnd(); err != nil {
			t.Errorf("caller's status: %v, want OK", err)
		}
		if err := tn.AgentEnd(); err != nil {
			t.Errorf("agent's status: %v, want OK", err)
		}
	})
	t.Run("agent first", func(t *testing.T) {
		tn := a.Establish(t, kcpPath, brokertest.Target("root"))
		tn.CloseWriteDown()
		tn.Up("after the agent's half-close")
		tn.Up("and more")
		tn.CloseWriteUp()
		if err := tn.AgentEnd(); err != nil {
			t.Errorf("agent's status: %v, want OK", err)
		}
		if err := tn.CallerEnd(); err != nil {
			t.Errorf("caller's status: %v, want OK", err)
		}
	})
}

func TestTunnelLostOnTheAgentsSideIsUnavailableToTheCaller(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, "a", "root")

	t.Run("agent cancels", func(t *testing.T) {
		tn := a.Establish(t, kcpPath, brokertest.Target("root"))
		tn.Up("x")
		tn.CancelAgent()
		testutil.CheckStatus(t, "caller", tn.CallerEnd(), codes.Unavailable, "tunnel lost on the agent's side")
		// After a failure the tunnel is released once both copiers have
		// returned, which may be just after the caller heard its status.
		testutil.Eventually(t, "the agent carries no tunnel after the end", func() bool {
			return b.Registry.Agents()[0].Tunnels() == 0
		})
	})
	t.Run("agent breaks the protocol", func(t *testing.T) {
		tn := a.Establish(t, kcpPath, brokertest.Target("root"))
		again := &tunnelv1.TunnelRequest{Frame: &tunnelv1.TunnelRequest_Open{Open: &tunnelv1.TunnelOpen{DialId: 1}}}
		if err := tn.Agent.Send(again); err != nil {
			t.Fatal(err)
		}
		testutil.CheckStatus(t, "caller", tn.CallerEnd(), codes.Unavailable, "protocol error: after opening, an agent may only send non-empty data")
		testutil.CheckStatus(t, "agent", tn.AgentEnd(), codes.Aborted, "tunnel aborted: protocol error")
	})
}

func TestCallerGoingAwayEndsTheAgentsTunnel(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, "a", "root")
	tn := a.Establish(t, kcpPath, brokertest.Target("root"))
	tn.Down("x")
	tn.CancelCaller()
	testutil.CheckStatus(t, "agent", tn.AgentEnd(), codes.Canceled, "caller went away")
}

func TestCallerBreakingTheProtocolAfterTheTarget(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, "a", "root")
	for _, tc := range []struct {
		name string
		msg  *tunnelv1.DialRequest
	}{
		{"a second target", &tunnelv1.DialRequest{Frame: &tunnelv1.DialRequest_Target{Target: brokertest.Target("root")}}},
		{"empty data", brokertest.DataUp([]byte{})},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tn := a.Establish(t, kcpPath, brokertest.Target("root"))
			tn.Up("fine so far")
			if err := tn.Caller.Send(tc.msg); err != nil {
				t.Fatal(err)
			}
			testutil.CheckStatus(t, "caller", tn.CallerEnd(), codes.InvalidArgument, "protocol error: after the target, a caller may only send non-empty data")
			testutil.CheckStatus(t, "agent", tn.AgentEnd(), codes.Canceled, "caller broke the protocol")
		})
	}
}

func TestIdleTunnelEndsWithDeadlineExceededOnBothLegs(t *testing.T) {
	const idle = 10 * time.Minute
	clk := brokertest.NewClock()
	b := startBroker(t, config{idleTimeout: idle, clock: clk})
	a := b.connectAgent(t, "a", "root")
	tn := a.Establish(t, kcpPath, brokertest.Target("root"))
	tn.Up("x")
	tn.Down("y")
	// Then nothing: the broker ends it.
	clk.Step(idle)
	testutil.CheckStatus(t, "caller", tn.CallerEnd(), codes.DeadlineExceeded, "tunnel carried nothing for 10m0s")
	testutil.CheckStatus(t, "agent", tn.AgentEnd(), codes.DeadlineExceeded, "tunnel carried nothing for 10m0s")
}

func TestATunnelThatCarriesDataIsNotIdle(t *testing.T) {
	const idle = 10 * time.Minute
	clk := brokertest.NewClock()
	b := startBroker(t, config{idleTimeout: idle, clock: clk})
	a := b.connectAgent(t, "a", "root")
	tn := a.Establish(t, kcpPath, brokertest.Target("root"))
	clk.Step(idle / 2)
	tn.Up("halfway")
	// The idle timer fires, finds the tunnel quiet for half the limit, and
	// waits for the other half.
	clk.Step(idle / 2)
	clk.WaitForTimers(t, 1)
	tn.Down("still open")
	clk.Step(idle)
	testutil.CheckStatus(t, "caller", tn.CallerEnd(), codes.DeadlineExceeded, "tunnel carried nothing for 10m0s")
}

func TestStoppingEndsTunnelsWithUnavailable(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, "a", "root")
	tn := a.Establish(t, kcpPath, brokertest.Target("root"))
	tn.Up("x")
	b.Drain()
	// Draining alone leaves tunnels in flight alone.
	tn.Down("still flowing while draining")
	b.Stop()
	testutil.CheckStatus(t, "caller", tn.CallerEnd(), codes.Unavailable, "the broker is shutting down and its grace period is over")
	testutil.CheckStatus(t, "agent", tn.AgentEnd(), codes.Unavailable, "the broker is shutting down")
}
