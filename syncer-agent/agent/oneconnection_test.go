package agent

import (
	"context"
	"testing"
	"time"

	"github.com/kcp-dev/tunnel-broker/internal/testutil"
)

// Behind a load balancer, a new connection may reach another replica: an
// agent with OneConnection keeps to its first, and leaves with it.

func TestAnAgentWithOneConnectionReturnsWhenItsConnectionIsGone(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	a := newAgent(t, p, b, staticResolver(t, "127.0.0.1:1"))
	a.OneConnection = true
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	b.nextSession(t)

	// The replica goes, and with it the connection: the agent does not
	// dial again, but drains and returns, its context still going.
	b.stop()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run: %v", err)
		}
	case <-time.After(waitLong):
		t.Fatal("Run did not return after its one connection was gone")
	}
	if _, err := a.dialOnce.dial(context.Background(), b.addr); err != errConnectionUsed {
		t.Errorf("a second connection: %v, want %v", err, errConnectionUsed)
	}
}

func TestAnAgentWithOneConnectionRetiresBeforeTheBrokerAsksForANewOne(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	b.maxConnectionAge = 10 * time.Minute
	a := newAgent(t, p, b, staticResolver(t, "127.0.0.1:1"))
	a.OneConnection = true
	retiring := make(chan struct{})
	a.Retiring = func() { close(retiring) }
	clk := fakeClock(a)
	run(t, a)
	b.nextSession(t)

	waitUntilWaiting(t, clk, "the connection's age")
	clk.Step(8*time.Minute - time.Second)
	select {
	case <-retiring:
		t.Fatal("retiring before 8/10 of the connection's age")
	case <-time.After(10 * time.Millisecond):
	}
	clk.Step(time.Second)
	testutil.Wait(t, "the agent to retire at 8/10 of the connection's age", retiring)
}
