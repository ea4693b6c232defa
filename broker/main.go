// Command broker terminates agents' control and tunnel streams and serves
// kcp's Dial RPC, all over SPIFFE mTLS.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"syscall"

	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"

	dialv1 "github.com/kcp-dev/tunnel-broker/broker/api/dial/v1"
	"github.com/kcp-dev/tunnel-broker/broker/server"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "broker:", err)
		os.Exit(1)
	}
}

func run() error {
	var (
		listen   = flag.String("listen", ":8443", "address to serve gRPC on")
		id       = flag.String("id", hostname(), "name of this replica, sent to agents")
		files    identity.Files
		timeout  = flag.Duration("dial-timeout", dialv1.DefaultTimeout, "how long a dial may wait for its agent")
		jsonLogs = flag.Bool("log-json", false, "log JSON lines instead of text")
		verbose  = flag.Bool("v", false, "log every tunnel, not only failures")
	)
	flag.StringVar(&files.Cert, "svid-cert", "", "X.509-SVID certificate chain (PEM, leaf first)")
	flag.StringVar(&files.Key, "svid-key", "", "X.509-SVID private key (PEM, PKCS#8)")
	flag.StringVar(&files.Bundle, "trust-bundle", "", "trust bundle of the broker's trust domain (PEM)")
	flag.Parse()

	log := newLogger(*jsonLogs, *verbose)
	if files.Cert == "" || files.Key == "" || files.Bundle == "" {
		return fmt.Errorf("--svid-cert, --svid-key and --trust-bundle are required: the broker serves only mTLS")
	}
	src, err := identity.Load(files)
	if err != nil {
		return err
	}
	l, err := net.Listen("tcp", *listen)
	if err != nil {
		return err
	}
	srv := server.New(server.Config{
		ID:          *id,
		Identity:    src,
		Authorize:   tlsconfig.AuthorizeMemberOf(src.ID().TrustDomain()),
		DialTimeout: *timeout,
		Log:         log,
	})
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	log.Info("broker serving", "address", l.Addr().String(), "id", src.ID().String(), "replica", *id)
	return srv.Serve(ctx, l)
}

func newLogger(json, verbose bool) *slog.Logger {
	opts := &slog.HandlerOptions{Level: slog.LevelInfo}
	if verbose {
		opts.Level = slog.LevelDebug
	}
	if json {
		return slog.New(slog.NewJSONHandler(os.Stderr, opts))
	}
	return slog.New(slog.NewTextHandler(os.Stderr, opts))
}

func hostname() string {
	h, _ := os.Hostname()
	return h
}
