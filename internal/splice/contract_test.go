package splice_test

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"testing"

	"github.com/kcp-dev/tunnel-broker/internal/splice"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// The contract every kind of leg keeps (Leg), each behaviour run over every
// kind (peers_test.go), as grpc-go's end-to-end tests run over every
// transport; then splices of every kind with every other.

// forEachKind runs test as a subtest for every kind of leg.
func forEachKind(t *testing.T, test func(t *testing.T, k kind, leg splice.Leg, p peer)) {
	for _, k := range kinds {
		t.Run(k.name, func(t *testing.T) {
			leg, p := k.pair(t)
			defer leg.End(errors.New("the test is over"))
			test(t, k, leg, p)
		})
	}
}

// data is a frame's payload of n bytes, each byte its position mod 251, so
// that a byte out of place shows.
func data(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i % 251)
	}
	return b
}

func sendData(t *testing.T, leg splice.Leg, b []byte) {
	t.Helper()
	f := wire.NewDataFrame(b)
	if err := leg.Send(&f); err != nil {
		t.Fatalf("Send: %v", err)
	}
}

// recvData receives n bytes from leg, in as many frames as they come in.
func recvData(t *testing.T, leg splice.Leg, n int) []byte {
	t.Helper()
	var got []byte
	for len(got) < n {
		var f wire.Frame
		if err := leg.Recv(&f); err != nil {
			t.Fatalf("Recv after %d of %d bytes: %v", len(got), n, err)
		}
		m, err := f.DataLen()
		if err != nil {
			t.Fatalf("Recv: %v", err)
		}
		b := make([]byte, m)
		_, _ = io.ReadFull(&f, b)
		f.Free()
		got = append(got, b...)
	}
	return got
}

func checkPeerGot(t *testing.T, p peer, want []byte) {
	t.Helper()
	got, err := p.recv(len(want))
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("the peer got %d bytes (%v), want the %d sent", len(got), err, len(want))
	}
}

func TestEveryLegCarriesDataBothWays(t *testing.T) {
	forEachKind(t, func(t *testing.T, _ kind, leg splice.Leg, p peer) {
		for _, n := range []int{1, 64, wire.MaxFrame} {
			if err := p.send(data(n)); err != nil {
				t.Fatal(err)
			}
			if got := recvData(t, leg, n); !bytes.Equal(got, data(n)) {
				t.Fatalf("the leg received %d bytes not as sent", n)
			}
			sendData(t, leg, data(n))
			checkPeerGot(t, p, data(n))
		}
	})
}

func TestEveryLegHalfClosesEachWayAlone(t *testing.T) {
	forEachKind(t, func(t *testing.T, _ kind, leg splice.Leg, p peer) {
		// The peer's half-close is the leg's io.EOF; the leg still sends.
		if err := p.closeWrite(); err != nil {
			t.Fatal(err)
		}
		var f wire.Frame
		if err := leg.Recv(&f); !errors.Is(err, io.EOF) {
			t.Fatalf("Recv after the peer's half-close: %v, want io.EOF", err)
		}
		sendData(t, leg, []byte("after the peer's half-close"))
		checkPeerGot(t, p, []byte("after the peer's half-close"))
		// The leg's half-close reaches the peer as its end of data.
		if err := leg.CloseWrite(); err != nil {
			t.Fatal(err)
		}
		if got, err := p.recv(1); !errors.Is(err, io.EOF) {
			t.Fatalf("the peer read %q, %v after the leg's half-close, want io.EOF", got, err)
		}
	})
	forEachKind(t, func(t *testing.T, _ kind, leg splice.Leg, p peer) {
		// The other way round: the leg first, and the peer still sends.
		if err := leg.CloseWrite(); err != nil {
			t.Fatal(err)
		}
		if got, err := p.recv(1); !errors.Is(err, io.EOF) {
			t.Fatalf("the peer read %q, %v after the leg's half-close, want io.EOF", got, err)
		}
		if err := p.send([]byte("after the leg's half-close")); err != nil {
			t.Fatal(err)
		}
		if got := recvData(t, leg, len("after the leg's half-close")); string(got) != "after the leg's half-close" {
			t.Fatalf("the leg received %q", got)
		}
	})
}

func TestEveryLegEndedCleanlyAfterBothHalfClosesEndsCleanly(t *testing.T) {
	forEachKind(t, func(t *testing.T, _ kind, leg splice.Leg, p peer) {
		if err := p.closeWrite(); err != nil {
			t.Fatal(err)
		}
		var f wire.Frame
		if err := leg.Recv(&f); !errors.Is(err, io.EOF) {
			t.Fatalf("Recv: %v, want io.EOF", err)
		}
		if err := leg.CloseWrite(); err != nil {
			t.Fatal(err)
		}
		if _, err := p.recv(1); !errors.Is(err, io.EOF) {
			t.Fatalf("the peer: %v, want io.EOF", err)
		}
		ended := make(chan struct{})
		go func() {
			defer close(ended)
			leg.End(nil)
		}()
		if err := p.end(); err != nil {
			t.Errorf("the peer's side ended with %v, want a clean end", err)
		}
		testutil.Wait(t, "End", ended)
	})
}

func TestEveryLegEndedWithAFailureTellsItsPeer(t *testing.T) {
	forEachKind(t, func(t *testing.T, k kind, leg splice.Leg, p peer) {
		sendData(t, leg, []byte("some"))
		checkPeerGot(t, p, []byte("some"))
		go leg.End(errors.New("the other leg failed"))
		err := p.end()
		if k.resets && err == nil {
			t.Errorf("the peer's side ended cleanly, want an error")
		}
		if !k.resets && err != nil {
			t.Errorf("the peer's side ended with %v; a Unix socket cannot say more than its end", err)
		}
		testutil.Wait(t, "the leg's context to end", leg.Context().Done())
	})
}

func TestEveryLegHearsItsPeerGoAway(t *testing.T) {
	forEachKind(t, func(t *testing.T, k kind, leg splice.Leg, p peer) {
		p.goAway()
		// A stream's context ends; a connection has none of its own, and
		// its next Recv fails (a Unix socket's ends, as a half-close).
		var f wire.Frame
		err := leg.Recv(&f)
		if k.resets && (err == nil || errors.Is(err, io.EOF)) {
			t.Errorf("Recv after the peer went away: %v, want an error", err)
		}
		if !k.resets && !errors.Is(err, io.EOF) {
			t.Errorf("Recv after the peer went away: %v, want io.EOF", err)
		}
	})
}

func TestAStreamLegsContextEndsWhenItsPeerGoesAwayAfterHalfClosing(t *testing.T) {
	forEachKind(t, func(t *testing.T, k kind, leg splice.Leg, p peer) {
		if !k.stream {
			t.Skip("a connection has no context of its own")
		}
		if err := p.closeWrite(); err != nil {
			t.Fatal(err)
		}
		var f wire.Frame
		if err := leg.Recv(&f); !errors.Is(err, io.EOF) {
			t.Fatalf("Recv: %v, want io.EOF", err)
		}
		// Nothing reads the leg any more: only its context can tell.
		p.goAway()
		testutil.Wait(t, "the leg's context to end", leg.Context().Done())
	})
}

func TestEveryLegsEndFreesASendBlockedOnAPeerThatDoesNotRead(t *testing.T) {
	forEachKind(t, func(t *testing.T, _ kind, leg splice.Leg, _ peer) {
		// The peer reads nothing: the sends fill every buffer and window
		// on the way and block, until the leg is ended.
		sending := make(chan error, 1)
		go func() {
			for {
				f := wire.NewDataFrame(data(wire.MaxFrame))
				if err := leg.Send(&f); err != nil {
					sending <- err
					return
				}
			}
		}()
		leg.End(errors.New("the other leg failed"))
		testutil.Wait(t, "the blocked Send to return", sending)
	})
}

func TestEveryLegFailsASendAfterItsEnd(t *testing.T) {
	forEachKind(t, func(t *testing.T, _ kind, leg splice.Leg, _ peer) {
		leg.End(errors.New("the other leg failed"))
		// A connection closes at once; a stream once its handler, or its
		// cancellation, has ended it.
		testutil.Eventually(t, "a Send after End to fail", func() bool {
			f := wire.NewDataFrame([]byte("late"))
			return leg.Send(&f) != nil
		})
	})
}

// A splice of every kind with every other carries data both ways and ends
// cleanly once both peers half-closed, whichever goroutine copies B's
// direction (Inline: the splice's own, as the agent's does).
func TestEveryKindSplicesWithEveryKind(t *testing.T) {
	for _, inline := range []bool{false, true} {
		for _, ka := range kinds {
			for _, kb := range kinds {
				t.Run(fmt.Sprintf("%s to %s, inline %v", ka.name, kb.name, inline), func(t *testing.T) {
					spliceCleanly(t, ka, kb, inline)
				})
			}
		}
	}
}

func spliceCleanly(t *testing.T, ka, kb kind, inline bool) {
	a, pa := ka.pair(t)
	b, pb := kb.pair(t)
	done := make(chan *splice.Failure, 1)
	go func() {
		f, _, _ := splice.Splice(a, b, splice.Config{Inline: inline})
		done <- f
	}()
	if err := pa.send(data(3 * wire.MaxFrame)); err != nil {
		t.Fatal(err)
	}
	checkPeerGot(t, pb, data(3*wire.MaxFrame))
	if err := pb.send([]byte("pong")); err != nil {
		t.Fatal(err)
	}
	checkPeerGot(t, pa, []byte("pong"))
	for _, p := range []peer{pa, pb} {
		if err := p.closeWrite(); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range []peer{pa, pb} {
		if _, err := p.recv(1); !errors.Is(err, io.EOF) {
			t.Fatalf("a peer: %v, want the other's half-close", err)
		}
	}
	ended := make(chan error, 2)
	for _, p := range []peer{pa, pb} {
		go func() { ended <- p.end() }()
	}
	if f := testutil.Wait(t, "the splice's end", done); f != nil {
		t.Errorf("the splice failed: %v, want a clean end", f)
	}
	for range 2 {
		if err := testutil.Wait(t, "a peer's end", ended); err != nil {
			t.Errorf("a peer's side ended with %v, want a clean end", err)
		}
	}
}

// A splice ends at the first failure and tells the other peer, even while
// the goroutine that called it is blocked copying (Inline).
func TestASpliceEndsAtItsFirstFailureWhicheverGoroutineCopies(t *testing.T) {
	for _, inline := range []bool{false, true} {
		for _, kb := range kinds {
			t.Run(fmt.Sprintf("%s goes away, inline %v", kb.name, inline), func(t *testing.T) {
				if !kb.resets {
					t.Skip("a Unix socket that goes away reads as its half-close")
				}
				a, pa := connPair(t, "tcp")
				b, pb := kb.pair(t)
				done := make(chan *splice.Failure, 1)
				go func() {
					f, _, _ := splice.Splice(a, b, splice.Config{Inline: inline})
					done <- f
				}()
				// Both copiers wait in Recv: nothing is sent.
				pb.goAway()
				f := testutil.Wait(t, "the splice's end", done)
				if f == nil || f.By != splice.B {
					t.Fatalf("the splice ended with %v, want a failure laid to B", f)
				}
				if err := pa.end(); err == nil {
					t.Error("the other peer's side ended cleanly, want an error")
				}
			})
		}
	}
}
