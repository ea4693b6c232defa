// Command syncer-agent runs beside a syncer: it registers with the broker
// the logical clusters it serves and connects dials to their Services.
package main

import (
	"strings"
	"time"

	"context"
	"flag"
	"fmt"
	"github.com/prometheus/client_golang/prometheus"
	"os"
	"os/signal"
	"syscall"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"

	"github.com/kcp-dev/tunnel-broker/internal/identity"
	"github.com/kcp-dev/tunnel-broker/internal/ops"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
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
		brokers  = flag.String("broker", "", "broker replica addresses, host:port, comma-separated")
		dns      = flag.String("broker-dns", "", "host:port whose host resolves to every broker replica (a headless Service)")
		every    = flag.Duration("resolve-interval", 30*time.Second, "how often --broker-dns is resolved again")
		grace    = flag.Duration("grace", agent.DefaultGrace, "on SIGTERM, how long tunnels in flight may still run")
		metricsL = flag.String("metrics-listen", ":9091", "address for /metrics, /healthz and /readyz (empty: off)")
		pprofL   = flag.String("pprof-listen", "", "address for /debug/pprof (empty: off; keep it on loopback)")
		brokerID = flag.String("broker-spiffe-id", "", "SPIFFE ID the broker must present (default: any ID in the agent's trust domain)")
		name     = flag.String("name", "", "name shown in the broker's logs and metrics, e.g. the sync target: a DNS-1123 label")
		jsonLogs = flag.Bool("log-json", false, "log JSON lines instead of text")
		verbose  = flag.Bool("v", false, "log every tunnel, not only failures")
		idOpts   = identity.AddFlags(flag.CommandLine)
	)
	resolverFlags := addResolverFlags(flag.CommandLine)
	flag.Parse()

	log := ops.NewLogger(*jsonLogs, *verbose)

	if *brokers == "" && *dns == "" {
		return fmt.Errorf("--broker or --broker-dns is required")
	}
	if err := tunnelv1.ValidateAgentName(*name); err != nil {
		return fmt.Errorf("--name: %w", err)
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
	// A broker that fails the handshake is named in the log, a few lines a
	// second at most, and counted.
	credentials := identity.ClientCredentials(src, authorize,
		identity.ReportRefusals(&identity.Refusals{Log: log, Count: agent.CountRefusedHandshake}))
	fleet := &agent.Fleet{
		Addresses:    splitList(*brokers),
		DNS:          *dns,
		ResolveEvery: *every,
		// New connections, with the new SVID, each time it rotates: the
		// brokers end a registration when the SVID it was made with expires.
		SVID:           src,
		CheckSVIDEvery: idOpts.Reload,
		Log:            log,
		Agent: func(addr string) *agent.Agent {
			return &agent.Agent{
				Broker:      addr,
				Credentials: credentials,
				Name:        *name,
				Resolver:    resolver.forAgent(),
				Grace:       *grace,
				Log:         log,
			}
		},
	}
	reg := prometheus.NewRegistry()
	agent.RegisterMetrics(reg)
	if err := ops.Serve(ctx, ops.Options{Listen: *metricsL, Pprof: *pprofL, Ready: fleet.Ready, Metrics: reg}, log); err != nil {
		return err
	}
	log.Info("agent starting", "brokers", *brokers, "broker_dns", *dns, "id", self.String(), "clusters", resolver.Clusters())
	if len(resolver.Clusters()) == 0 {
		log.Warn("no logical cluster to serve yet: registering with none, and again when one appears")
	}
	return fleet.Run(ctx)
}

func splitList(s string) []string {
	var out []string
	for _, part := range strings.Split(s, ",") {
		if part = strings.TrimSpace(part); part != "" {
			out = append(out, part)
		}
	}
	return out
}
