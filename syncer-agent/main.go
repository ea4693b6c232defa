// Command syncer-agent runs beside a syncer: it registers with the broker
// the logical clusters it serves and connects dials to their Services.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"google.golang.org/grpc/credentials"

	"github.com/kcp-dev/tunnel-broker/internal/flagcheck"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	"github.com/kcp-dev/tunnel-broker/internal/ops"
	"github.com/kcp-dev/tunnel-broker/internal/tracing"
	"github.com/kcp-dev/tunnel-broker/internal/version"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/agent"
)

func main() {
	os.Exit(flagcheck.Report(os.Stderr, "syncer-agent", run()))
}

// options are the agent's flags.
type options struct {
	brokers, dns, lb  string
	resolveEvery      time.Duration
	reconnectMaxDelay time.Duration
	grace             time.Duration
	metricsListen     string
	pprofListen       string
	brokerID          string
	name              string
	jsonLogs, verbose bool
	showVersion       bool
	identity          *identity.Options
	tracing           tracing.Config
	resolver          *resolverFlags
}

func addFlags(fs *flag.FlagSet) *options {
	o := &options{}
	fs.Var((*listFlag)(&o.brokers), "broker", "broker replica addresses, comma-separated `host:port,...`, each with its port (repeatable: the lists add up); one of --broker, --broker-dns and --broker-lb is required")
	fs.StringVar(&o.dns, "broker-dns", "", "host:port whose host resolves to every broker replica (a headless Service)")
	fs.StringVar(&o.lb, "broker-lb", "", "host:port of one load balancer in front of every broker replica, passing TCP (or TLS) through: the agent connects to it until it holds a registration with each replica the brokers count (their --replicas-dns)")
	fs.DurationVar(&o.resolveEvery, "resolve-interval", 30*time.Second, "how often --broker-dns is resolved again")
	fs.DurationVar(&o.reconnectMaxDelay, "reconnect-max-delay", agent.DefaultReconnectMaxDelay, "the longest wait between attempts to reach a broker replica: the agent is back about this long after a replica is")
	fs.DurationVar(&o.grace, "grace", agent.DefaultGrace, "on SIGTERM, how long tunnels in flight may still run")
	fs.StringVar(&o.metricsListen, "metrics-listen", ":9091", "address for /metrics, /healthz and /readyz (empty: off)")
	fs.StringVar(&o.pprofListen, "pprof-listen", "", "address for /debug/pprof (empty: off; keep it on loopback)")
	fs.StringVar(&o.brokerID, "broker-spiffe-id", "", "SPIFFE ID the broker must present (default: any ID in the agent's trust domain)")
	fs.StringVar(&o.name, "name", "", "required: name shown in the broker's logs and metrics, e.g. the sync target: a DNS-1123 label")
	o.tracing.AddFlags(fs)
	fs.BoolVar(&o.jsonLogs, "log-json", false, "log JSON lines instead of text")
	fs.BoolVar(&o.verbose, "v", false, "log every tunnel, not only failures")
	fs.BoolVar(&o.showVersion, "version", false, "print the version and exit")
	o.identity = identity.AddFlags(fs)
	o.resolver = addResolverFlags(fs)
	return o
}

// validate refuses what the flags cannot mean, as mistakes in the flags.
func (o *options) validate() error {
	switch {
	case o.brokers == "" && o.dns == "" && o.lb == "":
		return flagcheck.Errorf("--broker, --broker-dns or --broker-lb is required")
	case o.lb != "" && (o.brokers != "" || o.dns != ""):
		return flagcheck.Errorf("--broker-lb reaches every replica through one address: it takes neither --broker nor --broker-dns")
	}
	if o.lb != "" {
		if err := flagcheck.HostPort("broker-lb", o.lb); err != nil {
			return err
		}
	}
	for _, addr := range splitList(o.brokers) {
		if err := flagcheck.HostPort("broker", addr); err != nil {
			return err
		}
	}
	if o.dns != "" {
		if err := flagcheck.HostPort("broker-dns", o.dns); err != nil {
			return err
		}
	}
	if o.name == "" {
		return flagcheck.Errorf("--name is required: the agent's name in the broker's logs and metrics, e.g. the sync target's")
	}
	if err := tunnelv1.ValidateAgentName(o.name); err != nil {
		return flagcheck.Errorf("--name: %w", err)
	}
	if err := o.resolver.check(); err != nil {
		return &flagcheck.FlagError{Err: err}
	}
	return nil
}

// parseFlags parses args into fs: the agent's options, or a FlagError;
// flag.ErrHelp after --help printed the usage to stdout.
func parseFlags(fs *flag.FlagSet, args []string, stdout io.Writer) (*options, error) {
	o := addFlags(fs)
	flagcheck.Usage(fs, "syncer-agent: registers the logical clusters of a physical cluster with every tunnel broker replica and connects their dials to Services.",
		"syncer-agent (--broker HOST:PORT | --broker-dns HOST:PORT | --broker-lb HOST:PORT) --name NAME (--services FILE | --sync-target-name NAME ...)\n      (--spiffe-socket ADDR | --svid-cert FILE --svid-key FILE --trust-bundle FILE) [flags]")
	if err := flagcheck.Parse(fs, args, stdout); err != nil {
		return nil, err
	}
	// A duration that may not be off is positive: none takes 0 for its
	// default.
	if err := flagcheck.Check(fs, "reconnect-max-delay", "resolve-interval", "grace", "svid-reload-interval", "workload-api-timeout"); err != nil {
		return nil, err
	}
	if o.showVersion {
		return o, nil
	}
	return o, o.validate()
}

func run() error {
	o, err := parseFlags(flag.CommandLine, os.Args[1:], os.Stdout)
	if err != nil {
		return err
	}
	if o.showVersion {
		fmt.Println("syncer-agent", version.Get())
		return nil
	}
	log := ops.NewLogger(o.jsonLogs, o.verbose)
	o.tracing.Service, o.tracing.Version, o.tracing.Log = "syncer-agent", version.Get().String(), log
	stopTracing, err := tracing.Setup(o.tracing)
	if err != nil {
		return err
	}
	defer stopTracing()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	// The health port answers from the start, and through the drain after
	// SIGTERM, until run returns.
	opsCtx, stopOps := context.WithCancel(context.Background())
	defer stopOps()
	ready := ops.NewReadiness("waiting for the agent's X.509-SVID")
	reg := prometheus.NewRegistry()
	agent.RegisterMetrics(reg)
	reg.MustRegister(version.Collector("kcp_tunnel_agent"))
	if err := ops.Serve(opsCtx, ops.Options{Listen: o.metricsListen, Pprof: o.pprofListen, Ready: ready.Check, Metrics: reg}, log); err != nil {
		return err
	}
	src, self, err := identity.OpenWithID(ctx, *o.identity, log)
	if err != nil {
		return err
	}
	defer src.Close()
	return o.serve(ctx, src, self, ready, log)
}

// serve runs the agent, whose ID is self, with its identity until ctx ends.
func (o *options) serve(ctx context.Context, src identity.Source, self spiffeid.ID, ready *ops.Readiness, log *slog.Logger) error {
	authorize, err := o.authorizeBroker(self)
	if err != nil {
		return err
	}
	ready.NotReady("waiting for the Services of the physical cluster (caches syncing)")
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	resolver, err := o.resolver.newResolver(ctx, log)
	if err != nil {
		return err
	}
	defer resolver.stop()
	defer cancel() // resolver.stop waits for ctx to end
	// Register only with a complete view: the clusters served, and every
	// Service a dial may name.
	if err := resolver.ready(ctx); err != nil {
		return err
	}
	// A broker that fails the handshake is named in the log, a few lines a
	// second at most, and counted.
	refusals := identity.ReportRefusals(&identity.Refusals{Log: log, Count: agent.CountRefusedHandshake})
	creds := identity.ClientCredentials(src, authorize, refusals)
	fleet := o.fleet(src, creds, resolver, log)
	ready.Set(fleet.NotReady)
	log.Info("agent starting", "brokers", o.brokers, "broker_dns", o.dns, "id", self.String(), "clusters", resolver.Clusters(), "version", version.Get().String())
	if len(resolver.Clusters()) == 0 {
		log.Warn("no logical cluster to serve yet: registering with none, and again when one appears")
	}
	return fleet.Run(ctx)
}

// authorizeBroker accepts any broker in the agent's trust domain, or
// exactly --broker-spiffe-id.
func (o *options) authorizeBroker(self spiffeid.ID) (tlsconfig.Authorizer, error) {
	if o.brokerID == "" {
		return identity.AuthorizeMemberOf(self.TrustDomain(), "the agent (the trust domain of its own SVID, without --broker-spiffe-id)"), nil
	}
	id, err := spiffeid.FromString(o.brokerID)
	if err != nil {
		return nil, fmt.Errorf("--broker-spiffe-id: %w", err)
	}
	return identity.AuthorizeID(id, "--broker-spiffe-id"), nil
}

// fleet is the agent of every broker replica the flags name.
func (o *options) fleet(svids identity.Source, creds credentials.TransportCredentials, resolver *resolver, log *slog.Logger) *agent.Fleet {
	return &agent.Fleet{
		Addresses:    splitList(o.brokers),
		DNS:          o.dns,
		LoadBalancer: o.lb,
		ResolveEvery: o.resolveEvery,
		// New connections, with the new SVID, each time it rotates: the
		// brokers end a registration when the SVID it was made with expires.
		SVID:           svids,
		CheckSVIDEvery: o.identity.Reload,
		Log:            log,
		Agent: func(addr string) *agent.Agent {
			return &agent.Agent{
				Broker:            addr,
				Credentials:       creds,
				SVID:              svids,
				Name:              o.name,
				Resolver:          resolver.forAgent(),
				ReconnectMaxDelay: o.reconnectMaxDelay,
				Grace:             o.grace,
				Log:               log,
			}
		},
	}
}

// listFlag is a comma-separated list that a repeated flag adds to, so that
// --broker a --broker b keeps both.
type listFlag string

func (l *listFlag) String() string { return string(*l) }

func (l *listFlag) Set(v string) error {
	if *l != "" {
		v = string(*l) + "," + v
	}
	*l = listFlag(v)
	return nil
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
