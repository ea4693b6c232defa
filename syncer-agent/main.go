// Command syncer-agent runs beside a syncer: it registers with the broker
// the logical clusters it serves and connects dials to their Services.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"

	"github.com/kcp-dev/tunnel-broker/internal/identity"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/agent"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "syncer-agent:", err)
		os.Exit(1)
	}
}

func run() error {
	var (
		broker   = flag.String("broker", "", "broker address, host:port")
		brokerID = flag.String("broker-spiffe-id", "", "SPIFFE ID the broker must present (default: any ID in the agent's trust domain)")
		name     = flag.String("name", "", "name shown in the broker's logs, e.g. the sync target")
		jsonLogs = flag.Bool("log-json", false, "log JSON lines instead of text")
		verbose  = flag.Bool("v", false, "log every tunnel, not only failures")
		idOpts   = identity.AddFlags(flag.CommandLine)
	)
	resolverFlags := addResolverFlags(flag.CommandLine)
	flag.Parse()

	opts := &slog.HandlerOptions{Level: slog.LevelInfo}
	if *verbose {
		opts.Level = slog.LevelDebug
	}
	var log *slog.Logger
	if *jsonLogs {
		log = slog.New(slog.NewJSONHandler(os.Stderr, opts))
	} else {
		log = slog.New(slog.NewTextHandler(os.Stderr, opts))
	}

	if *broker == "" {
		return fmt.Errorf("--broker is required")
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
	authorize := tlsconfig.AuthorizeMemberOf(self.TrustDomain())
	if *brokerID != "" {
		id, err := spiffeid.FromString(*brokerID)
		if err != nil {
			return fmt.Errorf("--broker-spiffe-id: %w", err)
		}
		authorize = tlsconfig.AuthorizeID(id)
	}

	resolver, err := resolverFlags.newResolver(ctx, log)
	if err != nil {
		return err
	}
	defer resolver.stop()
	defer stop() // resolver.stop waits for ctx to end
	// Register only with a complete view: the clusters served, and every
	// Service a dial may name.
	if err := resolver.ready(ctx); err != nil {
		return err
	}
	a := &agent.Agent{
		Broker:      *broker,
		Credentials: identity.ClientCredentials(src, authorize),
		Name:        *name,
		Resolver:    resolver.Resolver, // itself, so that the agent sees it is a ClusterWatcher
		Log:         log,
	}
	log.Info("agent starting", "broker", *broker, "id", self.String(), "clusters", resolver.Clusters())
	if len(resolver.Clusters()) == 0 {
		log.Warn("no logical cluster to serve yet: registering with none, and again when one appears")
	}
	return a.Run(ctx)
}
