package e2e

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// This file holds what the churn and fault tests share: a baseline of the
// test process (the broker and agents run in it) to check leaks against,
// and target servers that misbehave in the ways a real Service can.

// baseline is what the process holds once its broker and agents are up and
// quiet: the goroutines running then, and the number of open files.
type baseline struct {
	goroutines goleak.Option
	fds        int
}

// settleTimeout bounds the wait for a process to get back to its baseline.
// kcpplugin holds a closed conn's stream for up to 2s (its close linger), and
// the abort that follows crosses the broker and the agent: far less than this.
const settleTimeout = 20 * time.Second

// quietBaseline waits until no tunnel is open on b's broker and the number of
// open files holds still, then takes a baseline: tunnels that earlier dials
// left lingering would otherwise count as part of it. Tunnels that stay
// open longer than any linger (an earlier check failed and left them) are
// taken into the baseline, with a note, so that later checks still judge
// only what happens after it.
func quietBaseline(t *testing.T, b *harness.Broker) baseline {
	t.Helper()
	const poll = 20 * time.Millisecond
	var (
		lastFDs          = -1
		lastTunnels      = int64(-1)
		stillFor         time.Duration
		deadline         = time.Now().Add(settleTimeout)
		longerThanLinger = 3 * time.Second
	)
	for {
		time.Sleep(poll)
		fds, tunnels := openFDs(t), brokerTunnels(b)
		if fds == lastFDs && tunnels == lastTunnels {
			stillFor += poll
		} else {
			lastFDs, lastTunnels, stillFor = fds, tunnels, 0
		}
		if tunnels == 0 && stillFor >= 5*poll {
			break
		}
		if stillFor >= longerThanLinger || time.Now().After(deadline) {
			t.Logf("%d tunnels stay open from before: they are part of the baseline", tunnels)
			break
		}
	}
	return baseline{goroutines: goleak.IgnoreCurrent(), fds: openFDs(t)}
}

// brokerTunnels is the number of tunnels b splices now.
func brokerTunnels(b *harness.Broker) int64 {
	var n int64
	for _, a := range b.Server.Registry.Agents() {
		n += a.Tunnels()
	}
	return n
}

// checkNoLeaks waits, up to settleTimeout, until every goroutine started since
// the baseline has ended and no more files are open than then. It compares
// open files exactly: the broker, the agents, the targets and the callers
// are all in this process, and nothing in the Go runtime opens files on its
// own once it runs, so any extra descriptor is a socket somebody kept.
func (b baseline) checkNoLeaks(t *testing.T, what string) {
	t.Helper()
	deadline := time.Now().Add(settleTimeout)
	for {
		leaked := goleak.Find(b.goroutines)
		fds := openFDs(t)
		if leaked == nil && fds <= b.fds {
			return
		}
		if time.Now().After(deadline) {
			if leaked != nil {
				t.Errorf("%s: goroutines left over after %v: %v", what, settleTimeout, leaked)
			}
			if fds > b.fds {
				t.Errorf("%s: %d files open after %v, %d before:\n%s", what, fds, settleTimeout, b.fds, describeFDs(t))
			}
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// openFDs counts this process's open file descriptors (the directory read
// itself holds one, the same each time).
func openFDs(t *testing.T) int {
	t.Helper()
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(entries)
}

// describeFDs lists what each open descriptor is, for a failure message.
func describeFDs(t *testing.T) string {
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return err.Error()
	}
	var lines []string
	for _, e := range entries {
		target, _ := os.Readlink(filepath.Join("/proc/self/fd", e.Name()))
		lines = append(lines, fmt.Sprintf("  fd %s -> %s", e.Name(), target))
	}
	return strings.Join(lines, "\n")
}

// Target servers: each handles a connection with its own goroutine, which
// must close the connection before it returns (or hand it to a hanger).
// startTarget serves handle on a loopback port until the test ends, and
// returns its address.
func startTarget(t *testing.T, handle func(c *net.TCPConn)) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				handle(c.(*net.TCPConn))
			}()
		}
	}()
	t.Cleanup(func() {
		l.Close()
		wg.Wait()
	})
	return l.Addr().String()
}

// hanger is a target that accepts and then does nothing at all: it neither
// reads nor writes nor closes, until released.
type hanger struct {
	mu   sync.Mutex
	held []net.Conn
}

func newHanger(t *testing.T) *hanger {
	h := &hanger{}
	t.Cleanup(func() { h.release() })
	return h
}

// hold is the hanger's handler.
func (h *hanger) hold(c *net.TCPConn) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.held = append(h.held, c)
}

// release closes the connections held so far, and says how many.
func (h *hanger) release() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := len(h.held)
	for _, c := range h.held {
		c.Close()
	}
	h.held = nil
	return n
}

// resetAtOnce aborts each connection as soon as it is accepted: RST, no FIN.
func resetAtOnce(c *net.TCPConn) {
	c.SetLinger(0)
	c.Close()
}

// closeAtOnce closes each connection as soon as it is accepted: FIN.
func closeAtOnce(c *net.TCPConn) { c.Close() }

// chatter sends a little every few milliseconds until a write fails, as a
// server that streams would; ended learns why it stopped, if not nil.
func chatter(ended chan<- error) func(c *net.TCPConn) {
	return func(c *net.TCPConn) {
		defer c.Close()
		msg := []byte(strings.Repeat("chatter ", 64))
		for {
			if _, err := c.Write(msg); err != nil {
				if ended != nil {
					ended <- err
				}
				return
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
}
