package wire

import (
	"bytes"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func readAllOf(t *testing.T, r io.Reader, want string) {
	t.Helper()
	got := make([]byte, len(want))
	if _, err := io.ReadFull(r, got); err != nil || string(got) != want {
		t.Fatalf("read %q, %v; want %q", got, err, want)
	}
}

func TestLegsCarryATunnelEachWayAndLeaveTheConnectionIdleForTheNext(t *testing.T) {
	a, b := tcpPair(t)
	for i := range 2 {
		left, right := NewLeg(a), NewLeg(b)
		if _, err := left.Write([]byte("ping")); err != nil {
			t.Fatal(err)
		}
		readAllOf(t, right, "ping")
		if _, err := right.Write(bytes.Repeat([]byte("p"), 3*MaxFrame)); err != nil {
			t.Fatal(err)
		}
		readAllOf(t, left, string(bytes.Repeat([]byte("p"), 3*MaxFrame)))
		if err := left.CloseWrite(); err != nil {
			t.Fatal(err)
		}
		if n, err := right.Read(make([]byte, 1)); n != 0 || err != io.EOF {
			t.Fatalf("tunnel %d: after the half-close %d, %v; want io.EOF", i, n, err)
		}
		if _, err := left.Write([]byte("more")); err == nil {
			t.Fatalf("tunnel %d: a write after the half-close went", i)
		}
		// The right side ends first; the left reads it and finishes.
		if err := right.End(nil); err != nil {
			t.Fatal(err)
		}
		if n, err := left.Read(make([]byte, 1)); n != 0 || err != io.EOF {
			t.Fatalf("tunnel %d: after an OK end %d, %v; want io.EOF", i, n, err)
		}
		if !left.Finish() || !right.Finish() {
			t.Fatalf("tunnel %d: the connection is not idle after the exchange", i)
		}
		if _, err := left.Read(make([]byte, 1)); !errors.Is(err, ErrTunnelEnded) {
			t.Fatalf("tunnel %d: a read of a finished leg: %v, want ErrTunnelEnded", i, err)
		}
	}
}

func TestAnEndWithAFailureReadsAsItsStatus(t *testing.T) {
	a, b := tcpPair(t)
	left, right := NewLeg(a), NewLeg(b)
	if err := left.End(status.Error(codes.Unavailable, "tunnel lost")); err != nil {
		t.Fatal(err)
	}
	_, err := right.Read(make([]byte, 1))
	if status.Code(err) != codes.Unavailable || status.Convert(err).Message() != "tunnel lost" {
		t.Fatalf("read %v, want the end's status", err)
	}
	if _, err := left.Write([]byte("x")); !errors.Is(err, ErrTunnelEnded) {
		t.Fatalf("a write after this side's end: %v, want ErrTunnelEnded", err)
	}
	if !right.Finish() || !left.Finish() {
		t.Fatal("the connection is not idle after the exchange")
	}
}

func TestFinishDropsWhatWasInFlightBeforeThePeersEnd(t *testing.T) {
	a, b := tcpPair(t)
	left, right := NewLeg(a), NewLeg(b)
	done := make(chan bool)
	go func() { done <- left.Finish() }()
	// The right side still sends before it reads the left's end.
	if _, err := right.Write(bytes.Repeat([]byte("z"), 100<<10)); err != nil {
		t.Fatal(err)
	}
	if _, err := right.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("the right side read %v, want the left's OK end", err)
	}
	if !right.Finish() || !<-done {
		t.Fatal("the connection is not idle after the exchange")
	}
}

func TestFinishGivesUpOnAPeerThatDoesNotEnd(t *testing.T) {
	a, _ := tcpPair(t)
	left := NewLeg(a)
	start := time.Now()
	if left.Finish() {
		t.Fatal("a silent peer left the connection idle")
	}
	if waited := time.Since(start); waited < EndTimeout/2 {
		t.Fatalf("gave up after %v, want about EndTimeout", waited)
	}
}

func TestFinishDropsNoMoreThanEndDrain(t *testing.T) {
	a, b := tcpPair(t)
	left := NewLeg(a)
	go func() {
		frame := AppendData(nil, bytes.Repeat([]byte("z"), MaxFrame))
		for sent := 0; sent <= 2*EndDrain; sent += MaxFrame {
			if _, err := b.Write(frame); err != nil {
				return
			}
		}
		_ = WriteEnd(b, nil)
	}()
	if left.Finish() {
		t.Fatalf("the leg dropped over %d bytes and kept the connection", 2*EndDrain)
	}
}

func TestFinishFreesAReadBlockedOnASilentPeer(t *testing.T) {
	a, _ := tcpPair(t)
	left := NewLeg(a)
	read := make(chan error)
	go func() {
		_, err := left.Read(make([]byte, 1))
		read <- err
	}()
	time.Sleep(10 * time.Millisecond) // the read blocks, or Finish goes first: either will do
	left.Finish()
	if err := <-read; err == nil {
		t.Fatal("the blocked read returned no error")
	}
}

func TestAFrameTheProtocolDoesNotAllowFailsTheReadAndTheConnection(t *testing.T) {
	a, b := tcpPair(t)
	left := NewLeg(a)
	if _, err := b.Write([]byte{6<<3 | 2, 1, 'x'}); err != nil {
		t.Fatal(err)
	}
	if _, err := left.Read(make([]byte, 1)); !errors.Is(err, ErrBadFrame) {
		t.Fatalf("read %v, want ErrBadFrame", err)
	}
	if left.Finish() {
		t.Fatal("a connection that broke the protocol was kept")
	}
}

func TestEndGivesUpOnAPeerThatReadsNothing(t *testing.T) {
	// A pipe's write waits for the peer's read, which never comes: a
	// socket's buffers, filled as a peer that reads nothing leaves them,
	// may still make room for a few bytes as the kernel tunes them.
	a, b := net.Pipe()
	t.Cleanup(func() { a.Close(); b.Close() })
	left := NewLeg(a)
	written := make(chan error, 1)
	go func() {
		_, err := left.Write([]byte("more"))
		written <- err
	}()
	if err := left.End(nil); err == nil {
		t.Fatal("an end sent to a peer that reads nothing went")
	}
	// A write blocked meanwhile, or one that comes after the end, fails.
	if err := <-written; err == nil {
		t.Fatal("a write to a peer that reads nothing returned no error after the end")
	}
	if left.Finish() {
		t.Fatal("the connection was kept")
	}
}

func TestAConnectionThatEndsMidTunnelIsNotAHalfClose(t *testing.T) {
	a, b := tcpPair(t)
	left := NewLeg(a)
	b.Close()
	if _, err := left.Read(make([]byte, 1)); err != io.ErrUnexpectedEOF {
		t.Fatalf("read %v, want io.ErrUnexpectedEOF", err)
	}
	if left.Finish() {
		t.Fatal("the connection was kept")
	}
}
