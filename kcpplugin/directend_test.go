package kcpplugin

import (
	"bytes"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// These tests are of a dial connection's tunnels after the broker's OK
// (docs/protocol.md §3.7): frames, the end exchange, and the connection
// going back to the pool for the next dial, or reset.

// keepTakenSparesOut has the Dialers the test makes open no replacement
// for a spare taken, so that the next dial finds a connection only if the
// last tunnel gave its own back. Call it before the Dialer is made.
func keepTakenSparesOut(t *testing.T) {
	old := spareReplaceAfterTake
	spareReplaceAfterTake = longerThanAnyWait
	t.Cleanup(func() { spareReplaceAfterTake = old })
}

// nthTunnel has the tunnels a fake broker reads go to handlers in turn,
// the last one for the rest.
func nthTunnel(handlers ...dialConnHandler) dialConnHandler {
	var n atomic.Int32
	return func(bt *brokerTunnel) bool {
		i := min(int(n.Add(1)), len(handlers)) - 1
		return handlers[i](bt)
	}
}

// finished waits for the broker's handler of bt to return.
func finished(t *testing.T, bt *brokerTunnel) *brokerTunnel {
	t.Helper()
	within(t, bt.done, "the broker's side of the tunnel ending")
	return bt
}

func wantFrames(t *testing.T, bt *brokerTunnel, want ...string) {
	t.Helper()
	if got := bt.readFrames(); !slices.Equal(got, want) {
		t.Fatalf("the broker read %q of tunnel %d, want %q", got, bt.connNum, want)
	}
}

func TestDialsInARowRideOneDialConnection(t *testing.T) {
	noGoroutinesLeftAtTheEnd(t)
	keepTakenSparesOut(t)
	b := startDialConnBroker(t, echoTunnel)
	d := b.dialer(t, 1, noStreams(t))
	d.EarlyData = true
	waitForSpares(t, d, b, 1)
	var last net.Conn
	for i := range 3 {
		c := dialTest(t, d)
		// The last conn's connection is this one's now: the last conn's
		// deadlines and Close leave it alone.
		if last != nil {
			_ = last.SetDeadline(time.Now())
			last.Close()
		}
		last = c
		early := fmt.Sprintf("hello %d", i)
		for _, msg := range []string{early, ", and again"} {
			if _, err := c.Write([]byte(msg)); err != nil {
				t.Fatalf("tunnel %d: Write: %v", i, err)
			}
		}
		if err := c.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
			t.Fatal(err)
		}
		if echoed, err := io.ReadAll(c); err != nil || string(echoed) != early+", and again" {
			t.Fatalf("tunnel %d read %q, %v; want the echo, then io.EOF", i, echoed, err)
		}
		// The broker's end follows its half-close: the connection goes
		// back to the pool with no Close.
		waitForSpares(t, d, b, 1)
		bt := finished(t, b.tunnel(t, i))
		if !bt.idle || bt.connNum != 1 || string(bt.req.GetEarlyData()) != early {
			t.Fatalf("tunnel %d: on connection %d, with early data %q, idle after: %v; want connection 1, %q, idle",
				i, bt.connNum, bt.req.GetEarlyData(), bt.idle, early)
		}
		wantFrames(t, bt, "data , and again", "close_write", "end OK")
		if _, err := c.Read(make([]byte, 1)); err != io.EOF {
			t.Fatalf("Read once the connection went back = %v, want io.EOF again", err)
		}
		if _, err := c.Write([]byte("late")); err == nil {
			t.Fatal("Write once the connection went back succeeded")
		}
	}
	if n := b.accepted.Load(); n != 1 {
		t.Fatalf("the broker accepted %d dial connections, want 1 for all three dials", n)
	}
}

func TestAFirstWriteLargerThanTheEarlyDataSendsTheRestInFrames(t *testing.T) {
	b := startDialConnBroker(t, echoTunnel)
	d := b.dialer(t, 1, noStreams(t))
	d.EarlyData = true
	waitForSpares(t, d, b, 1)
	c := dialTest(t, d)
	first := bytes.Repeat([]byte("e"), wire.MaxEarlyData+4<<10)
	if n, err := c.Write(first); n != len(first) || err != nil {
		t.Fatalf("Write = %d, %v", n, err)
	}
	if err := c.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if echoed, err := io.ReadAll(c); err != nil || !bytes.Equal(echoed, first) {
		t.Fatalf("read %d bytes, %v; want the %d written, then io.EOF", len(echoed), err, len(first))
	}
	bt := finished(t, b.tunnel(t, 0))
	wantFrames(t, bt, "data "+string(first[wire.MaxEarlyData:]), "close_write", "end OK")
	if n := len(bt.req.GetEarlyData()); n != wire.MaxEarlyData {
		t.Fatalf("the dial carried %d bytes of early data, want %d", n, wire.MaxEarlyData)
	}
}

// TestClosingMidTunnelHalfClosesSendsTheCallersEndAndTheConnectionCarriesTheNextDial:
// Close half-closes first, so that what was written reaches the target,
// and sends its end at once after it.
func TestClosingMidTunnelHalfClosesSendsTheCallersEndAndTheConnectionCarriesTheNextDial(t *testing.T) {
	noGoroutinesLeftAtTheEnd(t)
	keepTakenSparesOut(t)
	b := startDialConnBroker(t, echoTunnel)
	d := b.dialer(t, 1, noStreams(t))
	waitForSpares(t, d, b, 1)
	c := dialTest(t, d)
	roundTrip(t, c, "ping")
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	bt := finished(t, b.tunnel(t, 0))
	wantFrames(t, bt, "data ping", "close_write", "end Canceled: the caller closed the connection")
	if !bt.idle {
		t.Fatal("the connection was not idle after both ends")
	}
	if _, err := c.Read(make([]byte, 1)); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("Read after Close = %v, want net.ErrClosed", err)
	}
	waitForSpares(t, d, b, 1)
	roundTrip(t, dialTest(t, d), "pong")
	if n := b.tunnel(t, 1).connNum; n != 1 || b.accepted.Load() != 1 {
		t.Fatalf("the next dial rode connection %d of %d accepted, want the first and only one", n, b.accepted.Load())
	}
}

func TestTheBrokersEndWithAFailureReadsAsItsStatusAndTheConnectionIsReused(t *testing.T) {
	noGoroutinesLeftAtTheEnd(t)
	keepTakenSparesOut(t)
	lost := status.Error(codes.Unavailable, "tunnel lost on the agent's side")
	b := startDialConnBroker(t, nthTunnel(func(bt *brokerTunnel) bool {
		if bt.answer(nil) != nil {
			return false
		}
		if _, err := bt.next(); err != nil {
			return false
		}
		return bt.end(lost) == nil && bt.awaitEnd()
	}, echoTunnel))
	d := b.dialer(t, 1, noStreams(t))
	waitForSpares(t, d, b, 1)
	c := dialTest(t, d)
	if _, err := c.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	_, err := c.Read(make([]byte, 1))
	if st := status.Convert(err); st.Code() != codes.Unavailable || st.Message() != status.Convert(lost).Message() {
		t.Fatalf("Read = %v, want the broker's end: %v", err, lost)
	}
	waitForSpares(t, d, b, 1)
	if _, err := c.Write([]byte("y")); status.Code(err) != codes.Unavailable {
		t.Fatalf("Write after the broker's end = %v, want its status", err)
	}
	wantFrames(t, finished(t, b.tunnel(t, 0)), "data x", "end OK")
	roundTrip(t, dialTest(t, d), "next")
	if n := b.tunnel(t, 1).connNum; n != 1 || b.accepted.Load() != 1 {
		t.Fatalf("the next dial rode connection %d of %d accepted, want the first and only one", n, b.accepted.Load())
	}
}

// brokerFailure is what a fake broker's handler saw of the connection
// after the tunnel: when it read the caller's end, and when and how the
// connection then ended.
type brokerFailure struct {
	callersEnd, ended time.Time
	err               error
}

func TestABrokerThatNeverSendsItsEndHasTheConnectionResetAfterTheEndTimeout(t *testing.T) {
	noGoroutinesLeftAtTheEnd(t)
	silent := make(chan brokerFailure, 1)
	b := startDialConnBroker(t, nthTunnel(func(bt *brokerTunnel) bool {
		if bt.answer(nil) != nil || !bt.awaitEnd() {
			return false
		}
		f := brokerFailure{callersEnd: time.Now()}
		f.err = bt.readUntilFailure()
		f.ended = time.Now()
		silent <- f
		return false
	}, echoTunnel))
	d := b.dialer(t, 1, noStreams(t))
	waitForSpares(t, d, b, 1)
	c := dialTest(t, d)
	start := time.Now()
	c.Close()
	if took := time.Since(start); took >= wire.EndTimeout*3/4 {
		t.Fatalf("Close took %v: it waited for the broker's end", took)
	}
	f := within(t, silent, "the connection ending after the caller's end")
	if !errors.Is(f.err, syscall.ECONNRESET) {
		t.Fatalf("the broker's read ended with %v, want a reset", f.err)
	}
	if waited := f.ended.Sub(f.callersEnd); waited < wire.EndTimeout*3/4 {
		t.Fatalf("the connection was reset %v after the caller's end, want wire.EndTimeout (%v)", waited, wire.EndTimeout)
	}
	waitForSpares(t, d, b, 2)
	roundTrip(t, dialTest(t, d), "on a new connection")
	if n := b.tunnel(t, 1).connNum; n != 2 {
		t.Fatalf("the next dial rode connection %d, want the second", n)
	}
}

func TestAFrameTheProtocolDoesNotAllowFailsTheTunnelAndResetsTheConnection(t *testing.T) {
	noGoroutinesLeftAtTheEnd(t)
	failed := make(chan brokerFailure, 1)
	b := startDialConnBroker(t, nthTunnel(func(bt *brokerTunnel) bool {
		if bt.answer(nil) != nil {
			return false
		}
		// Field 5 of a ConnFrame: there is none.
		if _, err := bt.conn.Write([]byte{5<<3 | 2, 0}); err != nil {
			return false
		}
		f := brokerFailure{callersEnd: time.Now()}
		f.err = bt.readUntilFailure()
		f.ended = time.Now()
		failed <- f
		return false
	}, echoTunnel))
	d := b.dialer(t, 1, noStreams(t))
	waitForSpares(t, d, b, 1)
	c := dialTest(t, d)
	if _, err := c.Read(make([]byte, 8)); status.Code(err) != codes.Internal {
		t.Fatalf("Read = %v, want Internal: the broker broke the protocol", err)
	}
	f := within(t, failed, "the connection ending after the bad frame")
	if !errors.Is(f.err, syscall.ECONNRESET) {
		t.Fatalf("the broker's read ended with %v, want a reset", f.err)
	}
	if waited := f.ended.Sub(f.callersEnd); waited >= wire.EndTimeout {
		t.Fatalf("the connection was reset %v after the bad frame, want at once, not after an end exchange", waited)
	}
	if _, err := c.Write([]byte("x")); status.Code(err) != codes.Internal {
		t.Fatalf("Write after the bad frame = %v, want the tunnel's failure", err)
	}
	waitForSpares(t, d, b, 2)
	roundTrip(t, dialTest(t, d), "on a new connection")
	if n := b.tunnel(t, 1).connNum; n != 2 {
		t.Fatalf("the next dial rode connection %d, want the second", n)
	}
}

// A connection that ends inside a tunnel is a failure, not the tunnel's
// end: here the broker's close_notify comes right behind a data frame.
// Under TLS 1.2, whose alerts are records of their own type, crypto/tls
// returns a record's last bytes with io.EOF when a close_notify is in
// behind them (tls.Conn.Read).
func TestABrokerThatClosesTheConnectionMidTunnelFailsTheRead(t *testing.T) {
	noGoroutinesLeftAtTheEnd(t)
	certs := selfSignedMTLS(t)
	certs.server.NextProtos = []string{wire.DialProtocol}
	certs.server.MaxVersion = tls.VersionTLS12
	b := serveDialConns(t, nthTunnel(func(bt *brokerTunnel) bool {
		if bt.answer(nil) == nil {
			_ = bt.send([]byte("last"))
		}
		return false // the broker's serve closes the connection
	}, echoTunnel), certs)
	d := b.dialer(t, 1, noStreams(t))
	waitForSpares(t, d, b, 1)
	c := dialTest(t, d)
	finished(t, b.tunnel(t, 0))
	// Both records are in when Read starts, as crypto/tls needs to return
	// the data with io.EOF.
	time.Sleep(50 * time.Millisecond)
	got, err := io.ReadAll(c)
	if string(got) != "last" || status.Code(err) != codes.Unavailable {
		t.Fatalf("read %q, %v; want the data, then Unavailable", got, err)
	}
	waitForSpares(t, d, b, 2)
	roundTrip(t, dialTest(t, d), "on a new connection")
	if n := b.tunnel(t, 1).connNum; n != 2 {
		t.Fatalf("the next dial rode connection %d, want the second", n)
	}
}

func TestAWriteDeadlineThatPassesMidWriteResetsTheConnection(t *testing.T) {
	noGoroutinesLeftAtTheEnd(t)
	read := make(chan struct{})
	failed := make(chan error, 1)
	b := startDialConnBroker(t, nthTunnel(func(bt *brokerTunnel) bool {
		if bt.answer(nil) != nil {
			return false
		}
		<-read // until then, the caller's writes fill the socket's buffers
		failed <- bt.readUntilFailure()
		return false
	}, echoTunnel))
	d := b.dialer(t, 1, noStreams(t))
	waitForSpares(t, d, b, 1)
	c := dialTest(t, d)
	if err := c.SetWriteDeadline(time.Now().Add(50 * time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write(make([]byte, 64<<20)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Write = %v, want the write deadline", err)
	}
	close(read)
	if err := within(t, failed, "the connection ending after the write deadline"); !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("the broker's read ended with %v, want a reset", err)
	}
	c.Close()
	waitForSpares(t, d, b, 2)
	roundTrip(t, dialTest(t, d), "on a new connection")
	if n := b.tunnel(t, 1).connNum; n != 2 {
		t.Fatalf("the next dial rode connection %d, want the second", n)
	}
}

func TestClosingTheDialerMidEndExchangeLeavesNothingBehind(t *testing.T) {
	t.Run("after the caller's end", func(t *testing.T) {
		closeTheDialerOnASilentBroker(t, func(bt *brokerTunnel) error {
			if !bt.awaitEnd() {
				return errors.New("no end from the caller")
			}
			return nil
		}, func(c net.Conn) error { return c.Close() })
	})
	t.Run("after the broker's half-close", func(t *testing.T) {
		closeTheDialerOnASilentBroker(t, (*brokerTunnel).closeWrite, func(c net.Conn) error {
			if _, err := c.Read(make([]byte, 1)); err != io.EOF {
				return fmt.Errorf("Read = %v, want the broker's half-close", err)
			}
			return nil
		})
	})
}

// closeTheDialerOnASilentBroker has broker and caller play a tunnel up to
// where the broker falls silent, before its end, and then closes the
// Dialer: at once, with the connection reset and no goroutine left.
func closeTheDialerOnASilentBroker(t *testing.T, broker func(bt *brokerTunnel) error, caller func(c net.Conn) error) {
	noGoroutinesLeftAtTheEnd(t)
	silent := make(chan struct{})
	ended := make(chan error, 1)
	b := startDialConnBroker(t, func(bt *brokerTunnel) bool {
		if bt.answer(nil) != nil || broker(bt) != nil {
			return false
		}
		close(silent)
		ended <- bt.readUntilFailure()
		return false
	})
	d := b.dialer(t, 1, noStreams(t))
	waitForSpares(t, d, b, 1)
	if err := caller(dialTest(t, d)); err != nil {
		t.Fatal(err)
	}
	within(t, silent, "the broker falling silent")
	closed := make(chan time.Duration, 1)
	go func() {
		start := time.Now()
		_ = d.Close()
		closed <- time.Since(start)
	}()
	if took := within(t, closed, "Dialer.Close"); took >= wire.EndTimeout*3/4 {
		t.Fatalf("Dialer.Close took %v: it waited for the broker's end instead of resetting the connection", took)
	}
	if stack := goroutineIn("(*directConn).finishTunnel(", "(*directConn).awaitEnd("); stack != "" {
		t.Fatalf("Dialer.Close returned while a tunnel's end ran on:\n%s", stack)
	}
	if err := within(t, ended, "the broker's side of the connection ending"); !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("the broker's read ended with %v, want a reset", err)
	}
}

// goroutineIn is the stack of a goroutine running one of funcs now, if
// any: goleak would wait for it to end.
func goroutineIn(funcs ...string) string {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	for _, g := range strings.Split(string(buf), "\n\n") {
		for _, f := range funcs {
			if strings.Contains(g, f) {
				return g
			}
		}
	}
	return ""
}
