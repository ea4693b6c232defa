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

	dialv1 "github.com/kcp-dev/tunnel-broker/broker/api/dial/v1"
	"github.com/kcp-dev/tunnel-broker/broker/policy"
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
		listen     = flag.String("listen", ":8443", "address to serve gRPC on")
		id         = flag.String("id", hostname(), "name of this replica, sent to agents")
		policyFile = flag.String("policy", "", "authorization policy file (YAML): which SPIFFE IDs may register, dial and administer")
		timeout    = flag.Duration("dial-timeout", dialv1.DefaultTimeout, "how long a dial may wait for its agent")
		jsonLogs   = flag.Bool("log-json", false, "log JSON lines instead of text")
		verbose    = flag.Bool("v", false, "log every tunnel, not only failures")
		idOpts     = identity.AddFlags(flag.CommandLine)
	)
	flag.Parse()

	log := newLogger(*jsonLogs, *verbose)
	if *policyFile == "" {
		return fmt.Errorf("--policy is required: the broker admits no one by default")
	}
	pol, err := policy.Load(*policyFile)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	src, err := identity.Open(ctx, *idOpts, log)
	if err != nil {
		return err
	}
	defer src.Close()
	self, err := identity.IDOf(src)
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
		Policy:      pol,
		DialTimeout: *timeout,
		Log:         log,
	})
	log.Info("broker serving", "address", l.Addr().String(), "id", self.String(), "replica", *id)
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
