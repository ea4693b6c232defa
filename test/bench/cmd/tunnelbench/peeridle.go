package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"github.com/kcp-dev/tunnel-broker/test/bench"
)

// peerIdle is the idle figure for the peer: n tunnels through a fresh
// remotedialer server and client, to an echo target in a child process of
// its own. (Here the caller holds a Unix socket per tunnel besides, so with
// the targets in this process too, 10,000 tunnels would need more file
// descriptors than a process may have on our machines.)
func (r *runner) peerIdle(ctx context.Context, n int) {
	if r.idleEcho == "" {
		r.idleEcho, _ = startChild(r.m, "echo")
		r.idleEcho = r.hop(r.idleEcho)
	}
	pr := r.startPeer()
	defer pr.stop()
	procs := []middleProc{
		{"server", pr.serverPID, pr.serverPprof},
		{"client", pr.clientPID, pr.clientPprof},
	}
	p := path{name: peerName, dial: func(ctx context.Context, _ string) (net.Conn, error) {
		return pr.dial(ctx, r.idleEcho)
	}}
	run := r.holdIdle(ctx, p, svcIdle, n, procs)
	r.logf("%s idle %d: opened %d tunnels in %v", peerName, n, len(run.conns), run.took.Round(time.Millisecond))
	for _, c := range run.conns {
		c.Close()
	}
	r.waitClosed(ctx, pr, run.before[0].goroutines)
	idleRows(func(name string, v float64) { r.report.floorRow(peerName, name, none, v) }, n, procs, run)
}

// waitClosed waits (up to 30s) until the server is back to the goroutines
// it had before the tunnels opened: it has told the client to close every
// connection, so stopping the two does not race with that (the server would
// log each close it could no longer send).
func (r *runner) waitClosed(ctx context.Context, pr *peer, goroutines int) {
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		g, err := bench.Goroutines(ctx, pr.serverPprof)
		if err != nil || g <= goroutines {
			return
		}
	}
	r.logf("%s idle: the server still has more goroutines than before the tunnels 30s after they closed", peerName)
}

// serveEcho is the echo child's main: an echo target on a loopback port it
// prints, until stdin closes.
func serveEcho() {
	t, err := bench.StartEcho()
	if err != nil {
		fatalf("echo: %v", err)
	}
	fmt.Printf("listening %s\n", t.Addr)
	_, _ = io.Copy(io.Discard, os.Stdin)
	t.Close()
}
