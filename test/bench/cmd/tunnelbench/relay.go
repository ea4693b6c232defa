package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"time"
)

// The relay path is a floor for the tunnel, measured in the same run: the
// same hops a tunnel has (two middle processes, two mTLS legs, then TCP to
// the target), done the simplest way there is, without gRPC and without our
// code:
//
//	caller ──mTLS──▶ relay 1 ──mTLS──▶ relay 2 ──TCP──▶ target
//
// Each relay is a child process (see startChild) with an SVID of the bench's
// trust domain, requiring and verifying client certificates. Every
// connection gets TLS connections of its own (no multiplexing), and each
// relay copies bytes both ways with io.Copy, passing half-closes on. What
// the tunnel costs beyond this path is what gRPC and our code add; the rest
// is what any TLS tunnel through two processes pays on this machine.
//
// Relay 1 forwards everything to relay 2. Relay 2 learns the target from a
// header the caller sends once, right after its handshake: a length byte and
// the target's address; it dials the target and answers one byte (0), so
// that a dial returns when the stream is usable, as the tunnel's does. After
// that only the measured bytes flow.
const (
	relayCertEnv   = "TUNNELBENCH_RELAY_CERT"
	relayKeyEnv    = "TUNNELBENCH_RELAY_KEY"
	relayBundleEnv = "TUNNELBENCH_RELAY_BUNDLE"
	relayNextEnv   = "TUNNELBENCH_RELAY_NEXT" // relay 1: relay 2's address; relay 2: unset
)

// relayTimeout bounds a relay's handshakes and dials.
const relayTimeout = 10 * time.Second

// relay is the caller's side of the relay path.
type relay struct {
	addr   string      // relay 1
	pids   [2]int      // relay 1, relay 2
	client *tls.Config // the caller's mTLS
}

// startRelays starts relay 2, then relay 1 pointing at it, each with an SVID
// of its own, and loads the caller's. With -hop-delay, the caller reaches
// relay 1 and relay 1 relay 2 each through a delaying relay.
func (r *runner) startRelays() *relay {
	svid := func(path string) []string {
		f := r.env.SVID(path)
		return []string{relayCertEnv + "=" + f.Cert, relayKeyEnv + "=" + f.Key, relayBundleEnv + "=" + f.Bundle}
	}
	rl := &relay{}
	var addr2 string
	addr2, rl.pids[1] = startChild(r.m, "relay", svid("/relay-2")...)
	rl.addr, rl.pids[0] = startChild(r.m, "relay", append(svid("/relay-1"), relayNextEnv+"="+r.hop(addr2))...)
	rl.addr = r.hop(rl.addr)
	f := r.env.SVID("/relay-caller")
	cfg, err := relayTLS(f.Cert, f.Key, f.Bundle)
	if err != nil {
		r.m.Fatal(err)
	}
	rl.client = cfg
	return rl
}

// relayTLS is mTLS with the SVID in certFile and keyFile, trusting only the
// bench's trust bundle. As a server it requires and verifies client
// certificates; as a client it verifies the server's certificate for the
// address it dials (the harness's SVIDs name 127.0.0.1). Like production
// mTLS, though checking the chain only, not the SPIFFE ID.
func relayTLS(certFile, keyFile, bundleFile string) (*tls.Config, error) {
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, err
	}
	pem, err := os.ReadFile(bundleFile)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("%s: no certificates", bundleFile)
	}
	return &tls.Config{
		Certificates: []tls.Certificate{cert},
		RootCAs:      pool,
		ClientCAs:    pool,
		ClientAuth:   tls.RequireAndVerifyClientCert,
		MinVersion:   tls.VersionTLS12,
	}, nil
}

// path is the relay path to svc's target.
func (rl *relay) path(r *runner) path {
	return path{name: "relay", dial: func(ctx context.Context, svc string) (net.Conn, error) {
		return rl.dial(ctx, r.addrs[svc])
	}}
}

// relayConn is the caller's connection through the relays. handshake is how
// long its TCP connect and mTLS handshake to relay 1 took, of the whole
// dial.
type relayConn struct {
	*tls.Conn
	handshake time.Duration
}

// dial connects through both relays to target: TCP and mTLS to relay 1
// (which then connects to relay 2 the same way), the header, and relay 2's
// answer once it has connected to the target.
func (rl *relay) dial(ctx context.Context, target string) (net.Conn, error) {
	if len(target) > 255 {
		return nil, fmt.Errorf("target address %q too long", target)
	}
	start := time.Now()
	d := tls.Dialer{Config: rl.client}
	c, err := d.DialContext(ctx, "tcp", rl.addr)
	if err != nil {
		return nil, err
	}
	tc := c.(*tls.Conn)
	handshake := time.Since(start)
	if dl, ok := ctx.Deadline(); ok {
		_ = tc.SetDeadline(dl)
	}
	var ack [1]byte
	if _, err = tc.Write(append([]byte{byte(len(target))}, target...)); err == nil {
		_, err = io.ReadFull(tc, ack[:])
	}
	if err == nil && ack[0] != 0 {
		err = errors.New("bad answer")
	}
	if err != nil {
		tc.Close()
		return nil, fmt.Errorf("relay to %s: %w", target, err)
	}
	_ = tc.SetDeadline(time.Time{})
	return &relayConn{Conn: tc, handshake: handshake}, nil
}

// serveRelay is a relay child's main: accept mTLS connections on a loopback
// port it prints, and relay each to TUNNELBENCH_RELAY_NEXT over mTLS, or,
// without it, to the target its header names over TCP; until stdin closes.
func serveRelay() {
	cfg, err := relayTLS(os.Getenv(relayCertEnv), os.Getenv(relayKeyEnv), os.Getenv(relayBundleEnv))
	if err != nil {
		fatalf("relay: %v", err)
	}
	next := os.Getenv(relayNextEnv)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fatalf("relay: %v", err)
	}
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go relayOne(tls.Server(c, cfg), cfg, next)
		}
	}()
	fmt.Printf("listening %s\n", l.Addr())
	_, _ = io.Copy(io.Discard, os.Stdin)
	l.Close()
}

// relayOne completes in's handshake, connects onwards and copies both ways.
func relayOne(in *tls.Conn, cfg *tls.Config, next string) {
	fail := func(err error) {
		fmt.Fprintf(os.Stderr, "relay: %v\n", err)
		in.Close()
	}
	_ = in.SetDeadline(time.Now().Add(relayTimeout))
	if err := in.Handshake(); err != nil {
		fail(err)
		return
	}
	var out net.Conn
	var err error
	if next != "" {
		d := tls.Dialer{NetDialer: &net.Dialer{Timeout: relayTimeout}, Config: cfg}
		out, err = d.Dial("tcp", next)
	} else {
		out, err = dialTarget(in)
	}
	if err != nil {
		fail(err)
		return
	}
	_ = in.SetDeadline(time.Time{})
	splice(in, out)
}

// dialTarget reads the header from in, connects to the target it names and
// answers the caller.
func dialTarget(in *tls.Conn) (net.Conn, error) {
	var n [1]byte
	if _, err := io.ReadFull(in, n[:]); err != nil {
		return nil, err
	}
	target := make([]byte, n[0])
	if _, err := io.ReadFull(in, target); err != nil {
		return nil, err
	}
	out, err := net.DialTimeout("tcp", string(target), relayTimeout)
	if err != nil {
		return nil, err
	}
	if _, err := in.Write([]byte{0}); err != nil {
		out.Close()
		return nil, err
	}
	return out, nil
}

// splice copies a to b and b to a until both directions end. When one
// direction reaches EOF, its destination is half-closed (TCP FIN, or TLS
// close_notify) and the other direction goes on; an error ends both.
func splice(a, b net.Conn) {
	done := make(chan struct{}, 2)
	copyTo := func(dst, src net.Conn) {
		defer func() { done <- struct{}{} }()
		if _, err := io.Copy(dst, src); err != nil {
			a.Close()
			b.Close()
			return
		}
		if cw, ok := dst.(interface{ CloseWrite() error }); ok {
			_ = cw.CloseWrite()
		}
	}
	go copyTo(a, b)
	go copyTo(b, a)
	<-done
	<-done
	a.Close()
	b.Close()
}

// relayWanted is whether the relay path runs: -relay, and a phase that
// measures it.
func relayWanted(cfg config) bool {
	if !cfg.relay {
		return false
	}
	for _, p := range cfg.phases {
		switch p {
		case "throughput", "latency", "rps", "dial", "webhook":
			return true
		}
	}
	return false
}
