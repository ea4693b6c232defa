package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// The peer path is a real reverse tunnel measured next to ours, in the same
// run, against the same targets with the same load client: rancher's
// remotedialer, imported as a module by test/bench/peers/remotedialer (built
// by its build.sh, outside go.work: it needs a newer Go), whose binary
// -peer-remotedialer names:
//
//	caller ──CONNECT over a Unix socket──▶ server ══websocket, mTLS══▶ client ──TCP──▶ target
//
// The server and the client are child processes with SVIDs of the bench's
// trust domain, each checking the other's SPIFFE ID. The caller reaches the
// server the way callers reach Konnectivity's HTTP-CONNECT mode: a Unix
// socket and an HTTP CONNECT host:port per connection; the server dials
// through the client's session with remotedialer's dialer and copies bytes.
// Its rows are peer_remotedialer_<figure>, with a peer_remotedialer= column.
const peerName = "peer_remotedialer"

// peer is one server and client pair of the peer path.
type peer struct {
	socket                   string // the server's CONNECT front, as callers reach it
	serverPID, clientPID     int
	serverPprof, clientPprof string
	stop                     func() // both processes
}

// peerVersion is what the peer binary says it was built from.
func peerVersion(bin string) string {
	out, err := exec.Command(bin, "-version").Output()
	if err != nil {
		return "unknown (" + err.Error() + ")"
	}
	return strings.TrimSpace(string(out))
}

// startPeer starts a remotedialer server, then a client connected to it,
// and waits until the client says its session is up.
func (r *runner) startPeer() *peer {
	bin := r.cfg.peerBin
	serverSVID, clientSVID := r.env.SVID("/remotedialer-server"), r.env.SVID("/remotedialer-client")
	pr := &peer{
		socket:      filepath.Join(r.m.TempDir(), "connect.sock"),
		serverPprof: harness.FreeAddr(r.m),
		clientPprof: harness.FreeAddr(r.m),
	}
	server := exec.Command(bin, "-role", "server", "-socket", pr.socket,
		"-cert", serverSVID.Cert, "-key", serverSVID.Key, "-bundle", serverSVID.Bundle,
		"-peer-id", harness.ID("/remotedialer-client").String(), "-pprof-listen", pr.serverPprof)
	line, pid, stopServer := startProcess(r.m, "remotedialer server", server)
	addr, ok := strings.CutPrefix(line, "listening ")
	if !ok {
		r.m.Fatalf("remotedialer server said %q", line)
	}
	pr.serverPID = pid
	// With -hop-delay, callers reach the CONNECT front, and the client the
	// server, each through a delaying relay.
	pr.socket, addr = r.hopUnix(pr.socket), r.hop(addr)
	client := exec.Command(bin, "-role", "client", "-connect", "wss://"+addr+"/connect",
		"-cert", clientSVID.Cert, "-key", clientSVID.Key, "-bundle", clientSVID.Bundle,
		"-peer-id", harness.ID("/remotedialer-server").String(), "-pprof-listen", pr.clientPprof)
	line, pid, stopClient := startProcess(r.m, "remotedialer client", client)
	if line != "connected" {
		r.m.Fatalf("remotedialer client said %q", line)
	}
	pr.clientPID = pid
	pr.stop = func() { stopClient(); stopServer() }
	return pr
}

// path is the peer path to svc's target.
func (pr *peer) path(r *runner) path {
	return path{name: peerName, dial: func(ctx context.Context, svc string) (net.Conn, error) {
		return pr.dial(ctx, r.addrs[svc])
	}}
}

// dial asks the server's CONNECT front for a connection to target. The
// server answers once remotedialer's Dial has returned, which is when its
// request to the client is sent, not when the client has connected: so a
// dial alone is not comparable with the tunnel's, and the dial figures of
// the peer include the first round trip.
func (pr *peer) dial(ctx context.Context, target string) (net.Conn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", pr.socket)
	if err != nil {
		return nil, err
	}
	if dl, ok := ctx.Deadline(); ok {
		_ = c.SetDeadline(dl)
	}
	br := bufio.NewReader(c)
	_, err = fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", target, target)
	var resp *http.Response
	if err == nil {
		resp, err = http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	}
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("answered %s", resp.Status)
	}
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("%s to %s: %w", peerName, target, err)
	}
	_ = c.SetDeadline(time.Time{})
	if br.Buffered() > 0 {
		return &bufferedConn{Conn: c, r: br}, nil
	}
	return c, nil
}

// bufferedConn is a connection whose first bytes were read ahead with its
// CONNECT answer.
type bufferedConn struct {
	net.Conn
	r io.Reader
}

func (c *bufferedConn) Read(p []byte) (int, error) { return c.r.Read(p) }

// peerWanted is whether the peer path runs: a binary, and a phase that
// measures it.
func peerWanted(cfg config) bool {
	if cfg.peerBin == "" {
		return false
	}
	for _, p := range cfg.phases {
		switch p {
		case "throughput", "latency", "rps", "dial", "paced", "isolation", "webhook":
			return true
		}
	}
	return false
}

// newConnectionFailed takes the failure of a new connection on path p in
// a loop of them. The peer's is logged and its sample left out, and the
// loop counts it as a figure of its own (peer_remotedialer_*_failed): a
// peer that drops a connection under load is a finding, not the end of
// the run. On every other path a failure ends the run, as any bug of
// ours must.
func (r *runner) newConnectionFailed(p path, err error) {
	if p.name != peerName {
		r.m.Fatalf("%s: %v", p.name, err)
	}
	r.logf("%s: %v (left out)", p.name, err)
}
