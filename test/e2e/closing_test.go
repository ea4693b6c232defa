package e2e

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// How a tunnel's ends carry the last bytes, on the real broker and agent
// binaries, on the one path there is: the caller's Dial stream and the
// agent's Tunnel stream.

// pattern is the byte at offset i of what the callers below send.
func pattern(i int64) byte { return byte(i % 251) }

// patternChecker counts what it is given and checks it against pattern.
type patternChecker struct {
	n        int64
	mismatch int64 // offset of the first byte that is not pattern's, or -1
}

func (p *patternChecker) Write(b []byte) (int, error) {
	for i, c := range b {
		if p.mismatch < 0 && c != pattern(p.n+int64(i)) {
			p.mismatch = p.n + int64(i)
		}
	}
	p.n += int64(len(b))
	return len(b), nil
}

// received is what the sink target read on one connection, and how the
// connection ended (nil: a clean EOF).
type received struct {
	n, mismatch int64
	err         error
}

// startSink serves a target that reads each connection to its end, never
// writes, and reports what it read.
func startSink(t *testing.T) (addr string, got <-chan received) {
	ch := make(chan received, 64)
	addr = startTarget(t, func(c *net.TCPConn) {
		defer c.Close()
		_ = c.SetReadDeadline(time.Now().Add(settleTimeout))
		p := &patternChecker{mismatch: -1}
		_, err := io.Copy(p, c)
		ch <- received{n: p.n, mismatch: p.mismatch, err: err}
	})
	return addr, ch
}

// TestACallerThatWritesAndClosesAtOnceLosesNoByte: a caller that writes N
// bytes and closes its connection at once (Close, not CloseWrite), with
// kcpplugin's early data and without, loses none of them: the target reads
// exactly the N bytes, in order, and then a clean EOF, not a reset.
func TestACallerThatWritesAndClosesAtOnceLosesNoByte(t *testing.T) {
	env := harness.NewEnv(t)
	sink, got := startSink(t)
	_, addr := env.StartBrokerProcess()
	env.StartAgentProcess(addr, "/agent/sync-target-1", lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: "root", Namespace: "default", Name: "sink", Ports: map[string]string{"80": sink}},
	}})
	kcp := env.Dialer(addr, "/kcp")
	sizes := []int{0, 1, 100, 16<<10 - 1, 16 << 10, 16<<10 + 1, 64 << 10, 1 << 20}
	for _, early := range []bool{false, true} {
		d := *kcp
		d.EarlyData = early
		for _, n := range sizes {
			t.Run(fmt.Sprintf("early data %v, %d bytes", early, n), func(t *testing.T) {
				conn, err := d.DialService(t.Context(), "root", "default", "sink", 80)
				if err != nil {
					t.Fatalf("dial: %v", err)
				}
				msg := make([]byte, n)
				for i := range msg {
					msg[i] = pattern(int64(i))
				}
				_ = conn.SetWriteDeadline(time.Now().Add(settleTimeout))
				if w, err := conn.Write(msg); err != nil || w != n {
					conn.Close()
					t.Fatalf("wrote %d of %d bytes: %v", w, n, err)
				}
				if err := conn.Close(); err != nil {
					t.Logf("Close: %v", err)
				}
				next := func() received {
					t.Helper()
					select {
					case r := <-got:
						return r
					case <-time.After(settleTimeout):
						t.Fatalf("the target saw no end of its connection within %v", settleTimeout)
						return received{}
					}
				}
				if early && n == 0 {
					// Nothing written, nothing dialed: kcpplugin abandons the
					// dial, and the target may never see a connection. A
					// tunnel of 1 byte after it says when the target would
					// have seen one: what comes before it must be a clean
					// EOF of nothing.
					marker, err := kcp.DialService(t.Context(), "root", "default", "sink", 80)
					if err != nil {
						t.Fatalf("dial: %v", err)
					}
					if _, err := marker.Write([]byte{pattern(0)}); err != nil {
						t.Fatalf("write: %v", err)
					}
					marker.Close()
					for r := next(); r.n != 1; r = next() {
						if r.n != 0 || r.err != nil {
							t.Errorf("the target read %d bytes and %v, want nothing or a clean EOF of nothing", r.n, r.err)
						}
					}
					return
				}
				r := next()
				if r.n != int64(n) {
					t.Errorf("the target read %d bytes, want %d", r.n, n)
				}
				if r.mismatch >= 0 {
					t.Errorf("the target read a wrong byte at offset %d", r.mismatch)
				}
				switch {
				case r.err == nil:
				case errors.Is(r.err, syscall.ECONNRESET):
					t.Errorf("the target's connection was reset after %d bytes, want a clean EOF after %d: %v", r.n, n, r.err)
				default:
					t.Errorf("the target's read ended with %v after %d bytes, want a clean EOF after %d", r.err, r.n, n)
				}
			})
		}
	}
}

// TestTunnelsOneAfterAnotherHalfCloseBothWaysAndEndOK: dials one after
// another, with kcpplugin's early data and without, each a round trip,
// the caller's half-close, the echo's (its EOF) and then the caller's
// Close, end OK, each with one audit line that says so, and none fails.
// (It stands where dial and data connections' tests of ends one after
// another stood, on the gRPC streams that remain.)
func TestTunnelsOneAfterAnotherHalfCloseBothWaysAndEndOK(t *testing.T) {
	env := harness.NewEnv(t)
	broker, addr := env.StartBrokerProcess("--log-json")
	env.StartAgentProcess(addr, "/agent/sync-target-1", echoServices(harness.StartEcho(t)))
	kcp := env.Dialer(addr, "/kcp")
	const tunnels = 40
	for i := range tunnels {
		d := *kcp
		d.EarlyData = i%2 == 0
		conn, err := d.DialService(t.Context(), "root", "default", "echo", 80)
		if err != nil {
			t.Fatalf("tunnel %d: %v", i, err)
		}
		what := fmt.Sprintf("tunnel %d, early data %v", i, d.EarlyData)
		roundTrip(t, conn, what)
		if err := conn.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
			t.Fatalf("%s: CloseWrite: %v", what, err)
		}
		_ = conn.SetReadDeadline(time.Now().Add(settleTimeout))
		if rest, err := io.ReadAll(conn); err != nil || len(rest) != 0 {
			t.Fatalf("%s: after the half-close, read %q and %v, want the echo's EOF", what, rest, err)
		}
		conn.Close()
	}
	lines := broker.WaitLogged(t, tunnels, `"msg":"tunnel audit"`)
	ok := 0
	for _, l := range lines {
		var a auditLine
		if err := json.Unmarshal([]byte(l), &a); err != nil {
			t.Fatalf("audit line %s: %v", l, err)
		}
		// bytes_up leaves out early data, which goes with the dial.
		if a.Audit.Code == "OK" && a.Audit.BytesDown > 0 {
			ok++
		} else {
			t.Errorf("a tunnel did not end OK with its bytes echoed: %s", l)
		}
	}
	if len(lines) != tunnels || ok != tunnels {
		t.Errorf("%d audit lines, %d of them OK, want %d of each:\n%s", len(lines), ok, tunnels, strings.Join(lines, "\n"))
	}
}
