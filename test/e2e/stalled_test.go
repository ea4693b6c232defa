package e2e

import (
	"context"
	"fmt"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kcp-dev/tunnel-broker/broker/server"
	"github.com/kcp-dev/tunnel-broker/kcpplugin"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// A peer that has ended its side of a tunnel (its half-close) and then
// stops reading, while the other side keeps writing, leaves the tunnel
// stalled: nothing moves, and nothing ends it but the other side's end,
// the caller's cancel or the broker's idle limit. Whichever comes, the
// tunnel must go, and with it its place in the caller's quota and every
// goroutine and socket it held; the stalled peer must not pin them. The
// broker, the agent, the targets and the callers all run in this process,
// so that their goroutines and open files can be checked (leaks_test.go).

// stalledQuota is the caller's quota in these tests: small, so that one
// pinned tunnel would show as a refused dial.
const stalledQuota = 2

// stalledFlood is what the side that keeps writing has written before the
// tunnel is ended: more than its first windows, so that the writes wait
// on the peer that does not read.
const stalledFlood = 256 << 10

// stalled is a world of these tests: a broker, an agent serving echo and
// a target whose connections the test holds, and a caller.
type stalled struct {
	broker *harness.Broker
	kcp    *kcpplugin.Dialer
	held   chan *net.TCPConn
}

func newStalled(t *testing.T, config func(*server.Config)) *stalled {
	env := harness.NewEnv(t)
	w := &stalled{held: make(chan *net.TCPConn, 4)}
	w.broker = env.StartBroker(harness.BrokerOptions{Config: func(c *server.Config) {
		c.MaxTunnelsPerCaller = stalledQuota
		if config != nil {
			config(c)
		}
	}})
	// The test owns each connection of the held target from its accept.
	held := startTarget(t, func(c *net.TCPConn) { w.held <- c })
	env.StartAgent(w.broker.Addr, "/agent/sync-target-1", lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: "root", Namespace: "default", Name: "echo", Ports: map[string]string{"80": harness.StartEcho(t)}},
		{Cluster: "root", Namespace: "default", Name: "held", Ports: map[string]string{"80": held}},
	}})
	w.kcp = env.Dialer(w.broker.Addr, "/kcp")
	if err := echoDial(w.kcp); err != nil {
		t.Fatalf("warm-up dial: %v", err)
	}
	return w
}

// open dials the held target and returns both ends of the tunnel.
func (w *stalled) open(t *testing.T) (caller net.Conn, target *net.TCPConn) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	caller, err := w.kcp.DialService(ctx, "root", "default", "held", 80)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	select {
	case target = <-w.held:
	case <-time.After(settleTimeout):
		caller.Close()
		t.Fatalf("the target accepted no connection within %v", settleTimeout)
	}
	return caller, target
}

// flooder writes to a connection until a write fails.
type flooder struct {
	written atomic.Int64
	done    chan error
}

func flood(c net.Conn) *flooder {
	f := &flooder{done: make(chan error, 1)}
	go func() {
		chunk := make([]byte, 32<<10)
		for {
			n, err := c.Write(chunk)
			f.written.Add(int64(n))
			if err != nil {
				f.done <- err
				return
			}
		}
	}()
	return f
}

// stalls waits until f has written stalledFlood bytes.
func (f *flooder) stalls(t *testing.T, who string) {
	t.Helper()
	harness.Eventually(t, settleTimeout, who+" to write "+sizeOf(stalledFlood)+" into the tunnel", func() bool {
		return f.written.Load() >= stalledFlood
	})
}

// ends waits until f's writes have failed: the tunnel is gone under them.
func (f *flooder) ends(t *testing.T, who string) {
	t.Helper()
	select {
	case err := <-f.done:
		t.Logf("%s's writes ended after %s: %v", who, sizeOf(f.written.Load()), err)
	case <-time.After(settleTimeout):
		t.Fatalf("%s's writes still go on %v after the tunnel should have ended (%s written)", who, settleTimeout, sizeOf(f.written.Load()))
	}
}

func sizeOf(n int64) string { return fmt.Sprintf("%d KiB", n>>10) }

// released checks that the tunnel has gone from the broker and given its
// place in the caller's quota back: the caller can hold its whole quota
// of new tunnels, however the stalled peer's connection stands.
func (w *stalled) released(t *testing.T) {
	t.Helper()
	harness.Eventually(t, settleTimeout, "the broker to end the stalled tunnel", func() bool {
		return brokerTunnels(w.broker) == 0
	})
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	var err error
	harness.Eventually(t, settleTimeout, "the caller's whole quota to be free again", func() bool {
		for len(conns) < stalledQuota {
			var c net.Conn
			if c, err = dialEchoConn(w.kcp); err != nil {
				return false
			}
			conns = append(conns, c)
		}
		return true
	})
	for _, c := range conns {
		roundTrip(t, c, "a tunnel in the stalled one's place")
	}
}

func closeWrite(t *testing.T, c net.Conn) {
	t.Helper()
	if err := c.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
		t.Fatalf("CloseWrite: %v", err)
	}
}

// reset aborts c: RST, no FIN.
func reset(c *net.TCPConn) {
	_ = c.SetLinger(0)
	_ = c.Close()
}

// TestAPeerThatEndsAndStopsReadingDoesNotPinItsTunnel: once either end
// of a stalled tunnel closes or resets in a way the tunnel can see, the
// broker releases it and its place in the caller's quota. A caller that
// half-closes and reads nothing while the target floods it, and then the
// target resets, is not among them: the agent's copier from that target
// waits in a Send that the caller's unread window holds back, so no one
// reads the reset, and the idle limit ends that tunnel
// (TestATunnelStalledByACallerThatStopsReadingEndsAtTheIdleLimit).
func TestAPeerThatEndsAndStopsReadingDoesNotPinItsTunnel(t *testing.T) {
	for _, row := range []struct {
		name string
		run  func(t *testing.T, w *stalled, caller net.Conn, target *net.TCPConn)
	}{
		{"the caller half-closes and stops reading, and then closes", func(t *testing.T, w *stalled, caller net.Conn, target *net.TCPConn) {
			closeWrite(t, caller)
			f := flood(target)
			f.stalls(t, "the target")
			// With bytes unread, kcpplugin cancels the caller's stream.
			caller.Close()
			f.ends(t, "the target")
			w.released(t)
			target.Close()
		}},
		{"the target half-closes and stops reading, and then resets", func(t *testing.T, w *stalled, caller net.Conn, target *net.TCPConn) {
			if err := target.CloseWrite(); err != nil {
				t.Fatal(err)
			}
			f := flood(caller)
			f.stalls(t, "the caller")
			reset(target)
			f.ends(t, "the caller")
			w.released(t) // the caller has not closed
			caller.Close()
		}},
		{"the target half-closes and stops reading, and the caller closes", func(t *testing.T, w *stalled, caller net.Conn, target *net.TCPConn) {
			if err := target.CloseWrite(); err != nil {
				t.Fatal(err)
			}
			f := flood(caller)
			f.stalls(t, "the caller")
			caller.Close()
			f.ends(t, "the caller")
			w.released(t) // the target has neither read nor closed
			target.Close()
		}},
	} {
		// A world each, so that a tunnel one row leaves pinned does not
		// count in the next.
		t.Run(row.name, func(t *testing.T) {
			w := newStalled(t, nil)
			base := quietBaseline(t, w.broker)
			caller, target := w.open(t)
			defer func() {
				caller.Close()
				target.Close()
				if !t.Failed() {
					base.checkNoLeaks(t, row.name)
				}
			}()
			row.run(t, w, caller, target)
		})
	}
}

// TestATunnelStalledByACallerThatStopsReadingEndsAtTheIdleLimit: the
// caller half-closes and stops reading, the target writes until its
// writes wait and then closes (its FIN waits behind what it wrote). No end
// can come through, and nothing moves: the broker's idle limit ends the
// tunnel, and its place in the caller's quota comes back.
func TestATunnelStalledByACallerThatStopsReadingEndsAtTheIdleLimit(t *testing.T) {
	w := newStalled(t, func(c *server.Config) { c.IdleTimeout = time.Second })
	base := quietBaseline(t, w.broker)
	caller, target := w.open(t)
	closeWrite(t, caller)
	f := flood(target)
	f.stalls(t, "the target")
	// Close unblocks the flood's write; what the target wrote stays in
	// its socket, behind the caller that does not read.
	target.Close()
	f.ends(t, "the target")
	w.released(t) // the caller has neither read nor closed
	caller.Close()
	base.checkNoLeaks(t, "a tunnel stalled by its caller")
}
