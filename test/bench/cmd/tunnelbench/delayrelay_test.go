package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/kcp-dev/tunnel-broker/test/bench"
)

// testHopDelay is long next to a loopback round trip, so that a lower bound
// of it says the relay held the bytes; the tests assert no upper bound
// (these machines are shared and noisy).
const testHopDelay = 20 * time.Millisecond

// startDelayRelay serves a relay to upstream on network for the test.
func startDelayRelay(t *testing.T, network, upstream string) *delayRelay {
	t.Helper()
	addr := "127.0.0.1:0"
	if network == "unix" {
		addr = filepath.Join(t.TempDir(), "hop.sock")
	}
	d, err := listenDelayRelay(network, addr, upstream, testHopDelay)
	if err != nil {
		t.Fatal(err)
	}
	go d.serve()
	t.Cleanup(func() { d.Close() })
	return d
}

// dialRelay connects to d, with a deadline far off.
func dialRelay(t *testing.T, d *delayRelay) net.Conn {
	t.Helper()
	c, err := net.Dial(d.network, d.Addr())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(time.Minute))
	return c
}

// atLeast fails the test if took is under want, less a millisecond for
// the clocks' granularity.
func atLeast(t *testing.T, what string, took, want time.Duration) {
	t.Helper()
	if took < want-time.Millisecond {
		t.Errorf("%s took %v, under %v: not held", what, took, want)
	}
}

// TestDelayRelayHoldsBytesInOrder: through a relay to an echo target, a
// new connection's first round trip waits for the handshake's round trip
// too, each later one is held the delay each way, and a burst of writes
// of any size comes back whole and in order.
func TestDelayRelayHoldsBytesInOrder(t *testing.T) {
	echo, err := bench.StartEcho()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(echo.Close)
	d := startDelayRelay(t, "tcp", echo.Addr)

	start := time.Now()
	c := dialRelay(t, d)
	msg, buf := make([]byte, msgSize), make([]byte, msgSize)
	if err := bench.RoundTrip(c, msg, buf); err != nil {
		t.Fatal(err)
	}
	atLeast(t, "dial and first round trip", time.Since(start), 4*testHopDelay)
	for i := range 3 {
		msg[0] = byte(i)
		start := time.Now()
		if err := bench.RoundTrip(c, msg, buf); err != nil {
			t.Fatal(err)
		}
		atLeast(t, fmt.Sprintf("round trip %d", i), time.Since(start), 2*testHopDelay)
	}

	// A burst: writes of 1 B to 200 KiB, 4 MiB in all, more than a
	// direction holds.
	want := make([]byte, 4<<20)
	for i := range want {
		want[i] = byte(i * 7 / 3)
	}
	wrote := make(chan error, 1)
	start = time.Now()
	go func() {
		rest := want
		for len(rest) > 0 {
			n := min(len(rest), 1+rand.IntN(200<<10))
			if _, err := c.Write(rest[:n]); err != nil {
				wrote <- err
				return
			}
			rest = rest[n:]
		}
		wrote <- nil
	}()
	got := make([]byte, len(want))
	if _, err := io.ReadFull(c, got[:1]); err != nil {
		t.Fatal(err)
	}
	atLeast(t, "the burst's first byte", time.Since(start), 2*testHopDelay)
	if _, err := io.ReadFull(c, got[1:]); err != nil {
		t.Fatal(err)
	}
	if err := <-wrote; err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		i := 0
		for got[i] == want[i] {
			i++
		}
		t.Fatalf("the burst came back changed from byte %d on", i)
	}
	t.Logf("4 MiB there and back in %v (held %v each way)", time.Since(start).Round(time.Millisecond), testHopDelay)
}

// TestDelayRelayHalfClose: over TCP and over a Unix socket, a half-close
// reaches the target after the bytes before it and not before the delay,
// and the target's answer and its own half-close come back after it.
func TestDelayRelayHalfClose(t *testing.T) {
	for _, network := range []string{"tcp", "unix"} {
		t.Run(network, func(t *testing.T) {
			addr := "127.0.0.1:0"
			if network == "unix" {
				addr = filepath.Join(t.TempDir(), "target.sock")
			}
			l, err := net.Listen(network, addr)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { l.Close() })
			// The target reads to EOF, then answers how much it read and
			// half-closes.
			go func() {
				c, err := l.Accept()
				if err != nil {
					return
				}
				defer c.Close()
				n, _ := io.Copy(io.Discard, c)
				fmt.Fprintf(c, "read %d", n)
				_ = c.(interface{ CloseWrite() error }).CloseWrite()
				_, _ = io.Copy(io.Discard, c)
			}()
			d := startDelayRelay(t, network, l.Addr().String())
			c := dialRelay(t, d)
			if _, err := c.Write([]byte("hello")); err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			if err := c.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
				t.Fatal(err)
			}
			answer, err := io.ReadAll(c)
			if err != nil {
				t.Fatalf("after the answer %q: %v, want EOF", answer, err)
			}
			if string(answer) != "read 5" {
				t.Fatalf("the target answered %q, want %q", answer, "read 5")
			}
			atLeast(t, "the half-close there and the answer back", time.Since(start), 2*testHopDelay)
		})
	}
}

// TestDelayRelayReset: a target's reset reaches the caller as a reset.
func TestDelayRelayReset(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		var b [1]byte
		_, _ = c.Read(b[:])
		reset(c)
	}()
	d := startDelayRelay(t, "tcp", l.Addr().String())
	c := dialRelay(t, d)
	if _, err := c.Write([]byte{1}); err != nil {
		t.Fatal(err)
	}
	var b [1]byte
	if _, err := c.Read(b[:]); !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("read after the target's reset: %v, want a reset", err)
	}
}
