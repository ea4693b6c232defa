// Command remotedialer-peer runs one side of rancher/remotedialer, imported
// as a module at the version go.mod pins, so that tunnelbench can measure a
// real peer next to the tunnel, on the same machine and targets:
//
//	caller ──CONNECT over a Unix socket──▶ server ══websocket, mTLS══▶ client ──TCP──▶ target
//
// -role server accepts the client's websocket over mTLS and serves a Unix
// socket where each connection asks, with an HTTP CONNECT host:port, for a
// connection dialed through the client with remotedialer's dialer. -role
// client connects to the server and lets it dial loopback addresses only.
// Both use SVID files of tunnelbench's trust domain and check the other
// side's SPIFFE ID.
//
// Like tunnelbench's children, each prints one line once it is ready
// ("listening <addr>" for the server, "connected" for the client) and runs
// until its stdin closes, so that it never outlives the run.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	_ "net/http/pprof" // served on -pprof-listen only
	"os"
	"runtime/debug"
	"time"
)

// timeout bounds handshakes, CONNECT requests and dials.
const timeout = 10 * time.Second

func main() {
	var (
		role        = flag.String("role", "", "server or client")
		cert        = flag.String("cert", "", "SVID certificate (PEM)")
		key         = flag.String("key", "", "SVID key (PEM)")
		bundle      = flag.String("bundle", "", "trust bundle (PEM)")
		peerID      = flag.String("peer-id", "", "the other side's SPIFFE ID: the client's (server) or the server's (client)")
		listen      = flag.String("listen", "127.0.0.1:0", "server: the websocket's mTLS address")
		socket      = flag.String("socket", "", "server: the Unix socket of the CONNECT front")
		connect     = flag.String("connect", "", "client: the server's websocket URL, wss://host:port/connect")
		pprofListen = flag.String("pprof-listen", "", "if set, serve net/http/pprof on this loopback address")
		version     = flag.Bool("version", false, "print remotedialer's version and the Go version, and exit")
	)
	flag.Parse()
	if *version {
		fmt.Println(versions())
		return
	}
	tlsConfig, err := mutualTLS(*cert, *key, *bundle, *peerID)
	if err != nil {
		fatalf("%v", err)
	}
	if *pprofListen != "" {
		l, err := net.Listen("tcp", *pprofListen)
		if err != nil {
			fatalf("pprof: %v", err)
		}
		go func() { _ = http.Serve(l, http.DefaultServeMux) }()
	}

	// Stop when stdin closes: the parent exited or is done with us.
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		cancel()
	}()
	switch *role {
	case "server":
		if *socket == "" {
			fatalf("-socket is required")
		}
		err = serve(ctx, tlsConfig, *listen, *socket, *peerID)
	case "client":
		if *connect == "" {
			fatalf("-connect is required")
		}
		err = runClient(ctx, tlsConfig, *connect)
	default:
		fatalf("-role must be server or client, not %q", *role)
	}
	if err != nil && ctx.Err() == nil {
		fatalf("%s: %v", *role, err)
	}
}

// versions is "github.com/rancher/remotedialer <version> <go version>", as
// built into this binary.
func versions() string {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return "unknown"
	}
	for _, d := range info.Deps {
		if d.Path == "github.com/rancher/remotedialer" {
			return d.Path + " " + d.Version + " " + info.GoVersion
		}
	}
	return "unknown " + info.GoVersion
}

func fatalf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "remotedialer-peer: "+format+"\n", args...)
	os.Exit(2)
}
