package registry

import (
	"context"
	"errors"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// A tunnel's end: the dial that splices it finishes it, and the agent's
// Tunnel RPC, waiting in Wait, returns with that status.

func TestFinishEndsTheTunnelWithItsStatus(t *testing.T) {
	r := New()
	a := registerAgent(t, r, "a", "root")
	tun := claimedTunnel(t, r, "root", a)

	tun.Finish(status.Error(codes.Aborted, "the agent's leg failed"))
	checkStatus(t, "Wait", waitFinished(t, tun), codes.Aborted, "the agent's leg failed")
}

func TestCleanFinishEndsTheTunnelWithNoError(t *testing.T) {
	r := New()
	a := registerAgent(t, r, "a", "root")
	tun := claimedTunnel(t, r, "root", a)

	tun.Finish(nil)
	if err := waitFinished(t, tun); err != nil {
		t.Errorf("Wait: %v, want nil", err)
	}
}

func TestOnlyTheFirstFinishCounts(t *testing.T) {
	r := New()
	a := registerAgent(t, r, "a", "root")
	tun := claimedTunnel(t, r, "root", a)

	tun.Finish(nil)
	tun.Finish(status.Error(codes.Canceled, "caller went away"))
	if err := waitFinished(t, tun); err != nil {
		t.Errorf("Wait: %v, want the first Finish's nil", err)
	}
	if n := a.Tunnels(); n != 0 {
		t.Errorf("agent carries %d tunnels after finishing its only one twice, want 0", n)
	}
}

func TestTunnelsAreCountedPerAgentUntilFinished(t *testing.T) {
	r := New()
	a := registerAgent(t, r, "a", "root")
	b := registerAgent(t, r, "b", "other")
	first := claimedTunnel(t, r, "root", a)
	second := claimedTunnel(t, r, "root", a)
	if n, m := a.Tunnels(), b.Tunnels(); n != 2 || m != 0 {
		t.Fatalf("agents carry %d and %d tunnels, want 2 and 0", n, m)
	}
	first.Finish(nil)
	if n := a.Tunnels(); n != 1 {
		t.Errorf("agent carries %d tunnels after one of two finished, want 1", n)
	}
	second.Finish(nil)
	if n := a.Tunnels(); n != 0 {
		t.Errorf("agent carries %d tunnels after both finished, want 0", n)
	}
}

func TestTunnelsOutliveTheirAgentsRegistration(t *testing.T) {
	// An established tunnel has streams of its own: the agent's Connect
	// ending does not end it.
	r := New()
	a := registerAgent(t, r, "a", "root")
	tun := claimedTunnel(t, r, "root", a)

	r.Unregister(a)
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if err := tun.Wait(ctx); !errors.Is(err, context.Canceled) {
		t.Errorf("the tunnel ended with %v when its agent unregistered", err)
	}
	if n := a.Tunnels(); n != 1 {
		t.Errorf("agent carries %d tunnels, want 1", n)
	}
	tun.Finish(nil)
}

// The splice hands the agent's Tunnel RPC a half to run in its own goroutine.

func TestStartRunsTheHalfInTheTunnelRPCBeforeItsEnd(t *testing.T) {
	r := New()
	a := registerAgent(t, r, "a", "root")
	tun := claimedTunnel(t, r, "root", a)

	ran := make(chan struct{})
	ended := make(chan error, 1)
	go func() { ended <- tun.Wait(t.Context()) }()
	if !tun.Start(func() { close(ran) }) {
		t.Fatal("Start reported the Tunnel RPC gone while it waited")
	}
	<-ran
	select {
	case err := <-ended:
		t.Fatalf("Wait returned %v after its half, before Finish", err)
	default:
	}
	tun.Finish(status.Error(codes.Aborted, "after the half"))
	checkStatus(t, "Wait", <-ended, codes.Aborted, "after the half")
}

func TestWaitEndsWhenTheAgentsStreamEndsAndNothingStartsAfter(t *testing.T) {
	r := New()
	a := registerAgent(t, r, "a", "root")
	tun := claimedTunnel(t, r, "root", a)
	defer tun.Finish(nil)

	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if err := tun.Wait(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("Wait with an ended stream context: %v, want context.Canceled", err)
	}
	if tun.Start(func() { t.Error("the half ran with no Tunnel RPC to run it") }) {
		t.Error("Start reported success after the Tunnel RPC ended")
	}
}

func TestAStartedHalfRunsEvenIfTheStreamEndsAtOnce(t *testing.T) {
	// The half frees itself on an ended stream; the Tunnel RPC must not
	// return while it may still use the stream.
	r := New()
	a := registerAgent(t, r, "a", "root")
	tun := claimedTunnel(t, r, "root", a)

	ran := false
	// As in the splice, the tunnel is finished only after its half ran.
	if !tun.Start(func() { ran = true; tun.Finish(nil) }) {
		t.Fatal("Start failed before Wait")
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if err := tun.Wait(ctx); err != nil {
		t.Errorf("Wait: %v, want the Finish's nil", err)
	}
	if !ran {
		t.Error("Wait returned without running the half it was handed")
	}
}

func TestReleaseUncountsTheTunnelOnceBeforeFinish(t *testing.T) {
	r := New()
	a := registerAgent(t, r, "a", "root")
	tun := claimedTunnel(t, r, "root", a)
	claimedTunnel(t, r, "root", a) // another, still counted

	tun.Release()
	tun.Release()
	if n := a.Tunnels(); n != 1 {
		t.Errorf("agent carries %d tunnels after one of two was released twice, want 1", n)
	}
	tun.Finish(nil)
	if n := a.Tunnels(); n != 1 {
		t.Errorf("agent carries %d tunnels after the released one finished, want 1", n)
	}
}
