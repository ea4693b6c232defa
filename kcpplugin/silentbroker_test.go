package kcpplugin

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// This file tests a broker, or something else on its address, that
// completes the TLS handshake of a dial connection with the dial protocol
// (docs/protocol.md §3.6) and then never sends the OpenResult that accepts
// it as a spare: spareHandshakeTimeout bounds that wait, and no dial waits
// for it.

// silentBroker is the listener of dial connections of dialbroker_test.go's
// fake broker (the same real TLS on loopback, selfSignedMTLS), offering
// only wire.DialProtocol, that never writes a byte after the handshake. It
// reads each connection until it ends, to see the Dialer close it: through
// wire.CloseNotified, as the real broker reads one, so that a socket the
// Dialer dropped without closing it (closed by the garbage collector, say)
// does not read as closed by the Dialer.
type silentBroker struct {
	addr   string
	client *tls.Config
	lis    net.Listener
	served sync.WaitGroup

	mu     sync.Mutex
	open   []net.Conn    // every connection accepted and not yet closed here
	conns  []*silentConn // those whose handshake picked wire.DialProtocol
	hungUp bool
}

// silentConn is one dial connection whose handshake completed.
type silentConn struct {
	// sent counts the bytes the Dialer wrote on it: a spare not accepted
	// carries no dial, so none.
	sent atomic.Int64
	// ended is closed when the broker's read ends; err is why, set before.
	ended chan struct{}
	err   error
}

// startSilentBroker listens until the test ends.
func startSilentBroker(t *testing.T) *silentBroker {
	t.Helper()
	certs := selfSignedMTLS(t)
	certs.server.NextProtos = []string{wire.DialProtocol}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	b := &silentBroker{addr: lis.Addr().String(), client: certs.client, lis: lis}
	b.served.Add(1)
	go func() {
		defer b.served.Done()
		for {
			raw, err := lis.Accept()
			if err != nil {
				return
			}
			sock := &wire.Socket{Conn: raw}
			c := tls.Server(sock, certs.server)
			b.served.Add(1)
			go func() {
				defer b.served.Done()
				defer c.Close()
				b.serve(c, wire.CloseNotified(c, sock))
			}()
		}
	}()
	t.Cleanup(func() {
		b.hangUp()
		b.served.Wait()
	})
	return b
}

// serve completes c's handshake and then only reads it, as read (c under
// wire.CloseNotified), until it ends.
func (b *silentBroker) serve(c *tls.Conn, read net.Conn) {
	b.mu.Lock()
	if b.hungUp {
		b.mu.Unlock()
		return
	}
	b.open = append(b.open, c)
	b.mu.Unlock()
	if err := c.Handshake(); err != nil || c.ConnectionState().NegotiatedProtocol != wire.DialProtocol {
		return
	}
	sc := &silentConn{ended: make(chan struct{})}
	b.mu.Lock()
	b.conns = append(b.conns, sc)
	b.mu.Unlock()
	buf := make([]byte, 1024)
	for {
		n, err := read.Read(buf)
		sc.sent.Add(int64(n))
		if err != nil {
			sc.err = err
			close(sc.ended)
			return
		}
	}
}

// hangUp closes the listener and every connection: a stuck spare attempt
// then ends with EOF at once.
func (b *silentBroker) hangUp() {
	b.lis.Close()
	b.mu.Lock()
	b.hungUp = true
	open := b.open
	b.open = nil
	b.mu.Unlock()
	for _, c := range open {
		c.Close()
	}
}

// handshaken is how many connections have completed their handshake.
func (b *silentBroker) handshaken() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.conns)
}

// conn waits for the i-th connection (from 0) whose handshake completed.
func (b *silentBroker) conn(t *testing.T, i int) *silentConn {
	t.Helper()
	deadline := time.Now().Add(waitLong)
	for {
		b.mu.Lock()
		if len(b.conns) > i {
			sc := b.conns[i]
			b.mu.Unlock()
			return sc
		}
		b.mu.Unlock()
		if time.Now().After(deadline) {
			t.Fatalf("no dial connection #%d completed its handshake within %v", i+1, waitLong)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// dialer is a Dialer with dial connections to b and its Dial streams to a
// fake gRPC broker serving fallback. b hangs up before the Dialer closes
// in the test's cleanup, so that no test but the one of Dialer.Close
// relies on Close ending a spare attempt that is waiting for the broker.
func (b *silentBroker) dialer(t *testing.T, fallback dialHandler) *Dialer {
	t.Helper()
	d := dialerWith(t, fallback, WithDialConnections(DialConnections{Address: b.addr, TLS: b.client}))
	t.Cleanup(b.hangUp)
	return d
}

// closedByTheDialer says that the broker's read ended because the Dialer
// closed the connection (a close_notify: io.EOF through wire.CloseNotified)
// or reset it, not because the broker closed it or the socket ended without
// a close_notify (wire.ErrNoCloseNotify).
func closedByTheDialer(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET)
}

// setSpareHandshakeTimeout sets spareHandshakeTimeout for the test. Call it
// before the test's Dialer is made, so that the Dialer closes before it is
// restored.
func setSpareHandshakeTimeout(t *testing.T, d time.Duration) {
	old := spareHandshakeTimeout
	spareHandshakeTimeout = d
	t.Cleanup(func() { spareHandshakeTimeout = old })
}

// noGoroutinesLeftAtTheEnd checks, after the test's cleanups, that the
// test left no goroutine of its own running. The package's tests that run
// in parallel start only once this one has ended.
func noGoroutinesLeftAtTheEnd(t *testing.T) {
	opt := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, opt) })
}

// waitForTheAcceptanceRead waits until a goroutine is in the Dialer's read
// of the broker's acceptance. The broker's end of the handshake can come
// before the Dialer's: a Dialer closed then interrupts its handshake, and
// crypto/tls closes the socket without a close_notify.
func waitForTheAcceptanceRead(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(waitLong)
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n == len(buf) {
			buf = make([]byte, 2*len(buf))
			continue
		}
		if bytes.Contains(buf[:n], []byte("/wire.ReadAccepted(")) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no goroutine was reading the broker's acceptance (wire.ReadAccepted) within %v", waitLong)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// longerThanAnyWait is a spareHandshakeTimeout that no test waits for.
const longerThanAnyWait = 10 * waitLong

func TestDialsGoOnStreamsWhileTheBrokerHasNotAcceptedASpare(t *testing.T) {
	noGoroutinesLeftAtTheEnd(t)
	setSpareHandshakeTimeout(t, longerThanAnyWait)
	var streams atomic.Int32
	b := startSilentBroker(t)
	// The fake gRPC broker establishes each dial and echoes, its early
	// data first.
	d := b.dialer(t, func(stream tunnelv1.DialService_DialServer) error {
		streams.Add(1)
		first, err := stream.Recv()
		if err != nil {
			return err
		}
		if err := stream.Send(established); err != nil {
			return err
		}
		p := &peer{stream: stream, target: first.GetTarget()}
		if early := first.GetEarlyData(); len(early) > 0 {
			if err := p.send(early); err != nil {
				return err
			}
		}
		return p.echo()
	})
	stuck := b.conn(t, 0)
	waitForTheAcceptanceRead(t)

	for _, early := range []bool{false, true} {
		d.EarlyData = early
		ctx, cancel := context.WithCancel(context.Background())
		t.Cleanup(cancel) // frees a dial that waits for a spare
		type dialed struct {
			c   net.Conn
			err error
		}
		done := make(chan dialed, 1)
		go func() {
			c, err := d.DialService(ctx, testCluster, testNamespace, testService, testPort)
			done <- dialed{c, err}
		}()
		r := within(t, done, fmt.Sprintf("a dial (EarlyData %v) while the only spare attempt waits for the broker", early))
		if r.err != nil {
			t.Fatalf("EarlyData %v: DialService = %v", early, r.err)
		}
		t.Cleanup(func() { r.c.Close() })
		if err := r.c.SetDeadline(time.Now().Add(waitLong)); err != nil {
			t.Fatal(err)
		}
		roundTrip(t, r.c, fmt.Sprintf("on a stream, EarlyData %v", early))
	}

	if n := streams.Load(); n != 2 {
		t.Fatalf("%d dials went on Dial streams, want both", n)
	}
	select {
	case <-stuck.ended:
		t.Fatalf("the spare attempt ended (%v) before its timeout: the dials did not run while it waited", stuck.err)
	default:
	}
	if n := stuck.sent.Load(); n != 0 {
		t.Fatalf("the Dialer sent %d bytes on a connection the broker never accepted", n)
	}
	if n := b.handshaken(); n != 1 {
		t.Fatalf("%d dial connections completed their handshake, want only the one still waiting", n)
	}
}

func TestASpareTheBrokerNeverAcceptsIsClosedAtTheHandshakeTimeout(t *testing.T) {
	noGoroutinesLeftAtTheEnd(t)
	// Long enough for a TLS handshake on a loaded machine under the race
	// detector, so that the timeout passes while the Dialer waits for the
	// acceptance (an attempt whose handshake it cuts short is not counted
	// here, and the next one is).
	setSpareHandshakeTimeout(t, time.Second)
	b := startSilentBroker(t)
	b.dialer(t, noStreams(t))

	first := b.conn(t, 0)
	within(t, first.ended, "the Dialer closing a spare the broker never accepted")
	if !closedByTheDialer(first.err) {
		t.Fatalf("the broker's read of the silent connection ended with %v, want a close_notify or a reset by the Dialer", first.err)
	}
	if n := first.sent.Load(); n != 0 {
		t.Fatalf("the Dialer sent %d bytes on a connection the broker never accepted", n)
	}
	// The pool tries again, after its backoff.
	b.conn(t, 1)
}

func TestClosingTheDialerWhileASpareAwaitsAcceptanceReturnsAndLeavesNothingOpen(t *testing.T) {
	noGoroutinesLeftAtTheEnd(t)
	setSpareHandshakeTimeout(t, longerThanAnyWait)
	b := startSilentBroker(t)
	d := dialerWith(t, noStreams(t), WithDialConnections(DialConnections{Address: b.addr, TLS: b.client}))
	stuck := b.conn(t, 0)
	waitForTheAcceptanceRead(t)

	closed := make(chan error, 1)
	go func() { closed <- d.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatalf("Close = %v", err)
		}
	case <-time.After(waitLong):
		// Free Close, so that the test ends: the attempt reads EOF.
		b.hangUp()
		<-closed
		t.Fatalf("Dialer.Close did not return within %v while a spare attempt waited for the broker's acceptance (spareHandshakeTimeout %v): it waits for that timeout", waitLong, spareHandshakeTimeout)
	}
	within(t, stuck.ended, "the broker seeing the waiting spare closed")
	if !closedByTheDialer(stuck.err) {
		t.Fatalf("the broker's read of the waiting spare ended with %v, want a close_notify or a reset by the Dialer", stuck.err)
	}
	if n := b.handshaken(); n != 1 {
		t.Fatalf("%d dial connections completed their handshake, want 1: the Dialer tried again after Close", n)
	}
}
