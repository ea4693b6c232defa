package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/kcp-dev/tunnel-broker/test/bench"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// The hop delay (-hop-delay D). On loopback a hop costs what the processes
// at its ends spend on it; in a cluster each costs a network round trip
// too. With D > 0, every connection between two processes of every path
// crosses one delaying relay, which holds each chunk of bytes for D in each
// direction before passing it on:
//
//	direct:   caller ─D─▶ target
//	tunneled: kcp's dialer ─D─▶ broker ◀─D─ agent (its one connection), agent ─D─▶ target
//	connect:  caller ─D─▶ broker's CONNECT socket, then as tunneled
//	relay:    caller ─D─▶ relay 1 ─D─▶ relay 2 ─D─▶ target
//	peer:     caller ─D─▶ remotedialer server ◀─D─ remotedialer client (its session), client ─D─▶ target
//	grpc:     caller ─D─▶ gRPC echo child
//
// The Unix socket legs (the CONNECT fronts of the broker and of the peer)
// are delayed too, so that every path pays the same per hop. The relays are
// listeners in one child process (role "hops"), whose CPU no figure
// includes; the paths address them instead of the real listeners (the
// target addresses the agent's resolver names, the broker address the agent
// and kcp dial, and so on), so a connection crosses exactly one relay.
//
// Each direction of a relayed connection is a queue: a reader stamps each
// chunk it reads with its arrival time plus D, a writer sends it on once
// that time has come, so a burst is not held D per chunk. Half-closes (EOF)
// pass as half-closes and resets as resets (TCP, linger 0), each in order
// after the bytes before it and as late. A TCP handshake completes at once
// on loopback, before the relay sees it: so that a new connection still
// pays its round trip, the connecting side's first bytes are due no earlier
// than 3·D after the accept (SYN, SYN-ACK, then the bytes) and the accepting
// side's no earlier than 4·D. A process that waits for its connect before it
// speaks elsewhere (the agent, before a tunnel's established, unless kcp
// sends early data) does not wait for that round trip.

// Sizes of a relayed connection's buffers: what one read takes at most; what
// it takes while the connection carries messages rather than a stream (each
// connection holds one of these per direction; a message of this size or
// less is one chunk, held once: a webhook's request, a TLS handshake's
// flight); and how many chunks a direction holds at most, so at most
// hopQueue × hopChunk bytes (4 MiB) are in flight each way.
const (
	hopChunk     = 64 << 10
	hopSmallRead = 16 << 10
	hopQueue     = 64
)

// hopDelayEnv passes the hops child its delay.
const hopDelayEnv = "TUNNELBENCH_HOP_DELAY"

// delayRelay is one relay: a listener whose every connection it relays to
// upstream, holding each chunk for delay each way.
type delayRelay struct {
	l        net.Listener
	network  string // of both the listener and upstream: tcp or unix
	upstream string
	delay    time.Duration
}

// listenDelayRelay listens on addr for a relay to upstream.
func listenDelayRelay(network, addr, upstream string, delay time.Duration) (*delayRelay, error) {
	l, err := net.Listen(network, addr)
	if err != nil {
		return nil, err
	}
	return &delayRelay{l: l, network: network, upstream: upstream, delay: delay}, nil
}

// Addr is where the relay listens.
func (d *delayRelay) Addr() string { return d.l.Addr().String() }

// Close stops accepting; relayed connections go on.
func (d *delayRelay) Close() error { return d.l.Close() }

// serve relays every connection it accepts, until Close.
func (d *delayRelay) serve() {
	for {
		c, err := d.l.Accept()
		if errors.Is(err, net.ErrClosed) {
			return
		}
		if err != nil {
			// Out of descriptors, say: the caller's connect has not
			// completed its handshake yet, so it waits.
			fmt.Fprintf(os.Stderr, "hop relay %s: %v\n", d.Addr(), err)
			time.Sleep(10 * time.Millisecond)
			continue
		}
		go d.relay(c, time.Now())
	}
}

// relay connects to upstream for down, accepted at accepted, and copies both
// ways until both directions have ended.
func (d *delayRelay) relay(down net.Conn, accepted time.Time) {
	up, err := net.DialTimeout(d.network, d.upstream, relayTimeout)
	if err != nil {
		fmt.Fprintf(os.Stderr, "hop relay to %s: %v\n", d.upstream, err)
		reset(down)
		return
	}
	var once sync.Once
	abort := func() { once.Do(func() { reset(down); reset(up) }) }
	var wg sync.WaitGroup
	wg.Go(func() { d.pipe(up, down, accepted.Add(2*d.delay), abort) })
	wg.Go(func() { d.pipe(down, up, accepted.Add(3*d.delay), abort) })
	wg.Wait()
	down.Close()
	up.Close()
}

// hopBuffers are the relays' full-size read buffers.
var hopBuffers = sync.Pool{New: func() any { b := make([]byte, hopChunk); return &b }}

// chunk is bytes read from one side, or how that side ended (end: io.EOF
// for a half-close, any other error for a reset), due at the other side at
// due.
type chunk struct {
	data []byte
	buf  *[]byte // the pooled buffer data is in, if it is
	end  error
	due  time.Time
}

// pipe reads src into chunks, due delay after they arrive (and not before
// notBefore plus delay), and has them written to dst as they fall due, in
// order, until src ends and its end has been passed on. abort resets both
// sides.
func (d *delayRelay) pipe(dst, src net.Conn, notBefore time.Time, abort func()) {
	q := make(chan chunk, hopQueue)
	delivered := make(chan struct{})
	go func() {
		defer close(delivered)
		deliver(dst, q, abort)
	}()
	small := make([]byte, hopSmallRead)
	big := false // the last read filled its buffer: read more at once
	for {
		var c chunk
		buf := small
		if big {
			c.buf = hopBuffers.Get().(*[]byte)
			buf = *c.buf
		}
		n, err := src.Read(buf)
		now := time.Now()
		if now.Before(notBefore) {
			now = notBefore
		}
		c.due = now.Add(d.delay)
		switch {
		case n == 0 && c.buf != nil:
			hopBuffers.Put(c.buf)
			c.buf = nil
		case n > 0 && c.buf != nil:
			c.data = buf[:n]
		case n > 0:
			c.data = bytes.Clone(buf[:n])
		}
		big = n == len(buf)
		if n > 0 {
			q <- c
		}
		if err != nil {
			q <- chunk{end: err, due: c.due}
			close(q)
			break
		}
	}
	<-delivered
}

// deliver writes each chunk of q to dst once it is due, passes src's end on
// (a half-close, or a reset through abort), and after a failed write aborts
// and drops the rest.
func deliver(dst net.Conn, q <-chan chunk, abort func()) {
	var t hopTimer
	defer t.close()
	failed := false
	for c := range q {
		if !failed {
			t.waitUntil(c.due)
			switch {
			case c.end == nil:
				if _, err := dst.Write(c.data); err != nil {
					failed = true
					abort()
				}
			case errors.Is(c.end, io.EOF):
				if cw, ok := dst.(interface{ CloseWrite() error }); ok {
					_ = cw.CloseWrite()
				}
			default:
				failed = true
				abort()
			}
		}
		if c.buf != nil {
			hopBuffers.Put(c.buf)
		}
	}
}

// reset ends c with a TCP reset if it is a TCP connection (linger 0), else
// just closes it.
func reset(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	_ = c.Close()
}

// serveHops is the hops child's main: for each line "tcp <address>" or
// "unix <socket path>" on stdin, a relay to that upstream, delayed by
// TUNNELBENCH_HOP_DELAY, on a new loopback port or socket, answered with
// "listening <address>" (or "error <why>"); until stdin closes.
func serveHops() {
	delay, err := time.ParseDuration(os.Getenv(hopDelayEnv))
	if err != nil || delay <= 0 {
		fatalf("hops: bad %s %q", hopDelayEnv, os.Getenv(hopDelayEnv))
	}
	dir, err := os.MkdirTemp("", "hops-")
	if err != nil {
		fatalf("hops: %v", err)
	}
	defer os.RemoveAll(dir)
	var relays []*delayRelay
	in := bufio.NewScanner(os.Stdin)
	for n := 0; in.Scan(); n++ {
		network, upstream, _ := strings.Cut(in.Text(), " ")
		listen := "127.0.0.1:0"
		switch network {
		case "tcp":
		case "unix":
			listen = filepath.Join(dir, fmt.Sprintf("%d.sock", n))
		default:
			fmt.Printf("error unknown network %q\n", network)
			continue
		}
		d, err := listenDelayRelay(network, listen, upstream, delay)
		if err != nil {
			fmt.Printf("error %v\n", err)
			continue
		}
		relays = append(relays, d)
		go d.serve()
		fmt.Printf("listening %s\n", d.Addr())
	}
	for _, d := range relays {
		d.Close()
	}
}

// hops is tunnelbench's side of the hops child: it asks the child for
// relays.
type hops struct {
	delay time.Duration
	pid   int
	m     *harness.Main

	mu  sync.Mutex
	in  io.Writer
	out *bufio.Reader
}

// startHops starts the hops child, which m's cleanups stop.
func startHops(m *harness.Main, delay time.Duration) *hops {
	self, err := os.Executable()
	if err != nil {
		m.Fatal(err)
	}
	cmd := exec.Command(self)
	cmd.Env = append(os.Environ(), roleEnv+"=hops", hopDelayEnv+"="+delay.String())
	stdin, stdout, _ := spawn(m, cmd)
	return &hops{delay: delay, pid: cmd.Process.Pid, m: m, in: stdin, out: bufio.NewReader(stdout)}
}

// front is the address of a new relay to upstream, a TCP address or a
// Unix socket's path (network "tcp" or "unix").
func (h *hops) front(network, upstream string) string {
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, err := fmt.Fprintf(h.in, "%s %s\n", network, upstream); err != nil {
		h.m.Fatalf("hops child: %v", err)
	}
	line, err := h.out.ReadString('\n')
	if err != nil {
		h.m.Fatalf("hops child: %v", err)
	}
	addr, ok := strings.CutPrefix(strings.TrimSpace(line), "listening ")
	if !ok {
		h.m.Fatalf("hops child, relay to %s: %s", upstream, strings.TrimSpace(line))
	}
	return addr
}

// cpu is what the hops child has used so far.
func (h *hops) cpu() time.Duration {
	d, err := bench.ProcCPU(h.pid)
	if err != nil {
		h.m.Fatal(err)
	}
	return d
}

// hop is addr, a TCP address, behind a delaying relay of its own with
// -hop-delay; else addr.
func (r *runner) hop(addr string) string {
	if r.hops == nil {
		return addr
	}
	return r.hops.front("tcp", addr)
}

// hopUnix is hop for a Unix socket's path.
func (r *runner) hopUnix(path string) string {
	if r.hops == nil || path == "" {
		return path
	}
	return r.hops.front("unix", path)
}

// undelayedPhases are the phases -hop-delay leaves out: they measure what
// processes hold (idle tunnels, hostile streams, thousands of agents), not
// how long things take, and their thousands of connections would each need
// a relay.
var undelayedPhases = []string{"idle", "hostile", "scale"}
