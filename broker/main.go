// Command broker terminates agents' control and tunnel streams and serves
// kcp's Dial RPC, all over SPIFFE mTLS.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"os/signal"
	"syscall"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/kcp-dev/tunnel-broker/broker/admission"
	agentv1 "github.com/kcp-dev/tunnel-broker/broker/api/agent/v1"
	"github.com/kcp-dev/tunnel-broker/broker/internal/opening"
	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/broker/registry"
	"github.com/kcp-dev/tunnel-broker/broker/replicas"
	"github.com/kcp-dev/tunnel-broker/broker/server"
	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
	"github.com/kcp-dev/tunnel-broker/internal/flagcheck"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	"github.com/kcp-dev/tunnel-broker/internal/ops"
	"github.com/kcp-dev/tunnel-broker/internal/tracing"
	"github.com/kcp-dev/tunnel-broker/internal/version"
)

func main() {
	os.Exit(flagcheck.Report(os.Stderr, "broker", run()))
}

func run() error {
	o, err := parseFlags(flag.CommandLine, os.Args[1:], os.Stdout)
	if err != nil {
		return err
	}
	if o.showVersion {
		fmt.Println("broker", version.Get())
		return nil
	}
	log := ops.NewLogger(o.jsonLogs, o.verbose)
	pol, err := policy.Load(o.policyFile)
	if err != nil {
		return fmt.Errorf("--policy: %w", err)
	}
	for _, w := range pol.Warnings() {
		log.Warn("policy rule can never match as written", "policy", o.policyFile, "rule", w)
	}
	o.tracing.Service, o.tracing.Version, o.tracing.Log = "tunnel-broker", version.Get().String(), log
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
	ready := ops.NewReadiness("waiting for the broker's X.509-SVID")
	metrics.Registry.MustRegister(version.Collector("kcp_tunnel_broker"))
	if err := ops.Serve(opsCtx, ops.Options{Listen: o.opsListen, Pprof: o.pprof, Ready: ready.Check, Metrics: metrics.Registry}, log); err != nil {
		return err
	}
	src, self, err := identity.OpenWithID(ctx, *o.identity, log)
	if err != nil {
		return err
	}
	defer src.Close()
	cfg := o.cfg
	cfg.Identity, cfg.Policy, cfg.Log = src, pol, log
	if o.replicasDNS != "" {
		cfg.Replicas = &replicas.Counter{Name: o.replicasDNS, Log: log.With("component", "replicas")}
		go cfg.Replicas.Run(ctx)
	}
	return serve(ctx, o, cfg, self, ready)
}

// serve runs the replica, whose ID is self, on o.listen until ctx ends.
func serve(ctx context.Context, o *options, cfg server.Config, self spiffeid.ID, ready *ops.Readiness) error {
	l, err := net.Listen("tcp", o.listen)
	if err != nil {
		return fmt.Errorf("--listen: %w", err)
	}
	srv := server.New(cfg)
	agents := metrics.AgentsCollector{Totals: func() (int64, int64, int64) {
		s := srv.Registry.Stats()
		return s.Agents, s.Clusters, s.SingleAgentClusters
	}}
	if o.metricsPerCluster {
		agents.PerCluster = srv.Registry.AgentsPerCluster
	}
	metrics.Registry.MustRegister(agents)
	ready.Set(srv.NotReady)
	egress, err := o.egress.listen(srv, cfg.Log)
	if err != nil {
		return err
	}
	cfg.Log.Info("broker serving", "address", l.Addr().String(), "id", self.String(), "replica", cfg.ID, "version", version.Get().String())
	err = srv.Serve(ctx, l)
	return errors.Join(err, egress())
}

// options are the broker's flags: the replica's Config, but for what run
// makes (identity, policy, log), and run's own.
type options struct {
	cfg                                  server.Config
	listen, policyFile, opsListen, pprof string
	replicasDNS                          string
	jsonLogs, verbose, showVersion       bool
	metricsPerCluster                    bool
	identity                             *identity.Options
	egress                               egressFlags
	tracing                              tracing.Config
}

// parseFlags parses args into fs: the broker's options, or a FlagError;
// flag.ErrHelp after --help printed the usage to stdout.
func parseFlags(fs *flag.FlagSet, args []string, stdout io.Writer) (*options, error) {
	o := &options{}
	c := &o.cfg
	maxStreams, window := o.addFlags(fs)
	if err := flagcheck.Parse(fs, args, stdout); err != nil {
		return nil, err
	}
	// A duration that may not be off is positive: none takes 0 for its
	// default.
	if err := flagcheck.Check(fs, "max-message-size", "max-concurrent-streams", "dial-timeout", "grace", "idle-timeout",
		"handshake-timeout", "expired-peer-grace", "max-connection-age", "startup-grace", "probe-interval",
		"svid-reload-interval", "workload-api-timeout"); err != nil {
		return nil, err
	}
	if o.showVersion {
		return o, nil
	}
	if o.policyFile == "" {
		return nil, flagcheck.Errorf("--policy is required: the broker admits no one by default")
	}
	if err := checkWindowSize(*window); err != nil {
		return nil, err
	}
	if err := o.egress.check(); err != nil {
		return nil, err
	}
	c.MaxConcurrentStreams = uint32(min(*maxStreams, math.MaxUint32))
	c.WindowSize = int32(*window)
	// A limit flag's 0 means no limit, and Config's the default.
	noLimitIfZero(&c.Limits.MaxPendingPerCluster, &c.Limits.MaxTunnelsPerAgent, &c.MaxTunnelsPerCaller,
		&c.MaxOpeningStreamsPerPeer, &c.MaxOpeningStreams, &c.MaxRegistrationsPerAgent,
		&c.MaxEarlyDataPerCaller, &c.MaxEarlyData)
	noLimitIfZero(&c.MaxClustersPerRegistration, &c.MaxHandshakes)
	return o, nil
}

// addFlags defines the broker's flags on fs, into o; the two that need a
// conversion after parsing are returned.
func (o *options) addFlags(fs *flag.FlagSet) (maxStreams *uint, window *int) {
	c := &o.cfg
	flagcheck.Usage(fs, "broker: the kcp tunnel broker; terminates syncer-agents' control and tunnel streams and serves kcp's Dial, over SPIFFE mTLS.",
		"broker --policy FILE (--spiffe-socket ADDR | --svid-cert FILE --svid-key FILE --trust-bundle FILE) [flags]")
	fs.StringVar(&o.listen, "listen", ":8443", "address to serve gRPC on")
	fs.StringVar(&c.ID, "id", hostname(), "name of this replica, sent to agents")
	fs.StringVar(&o.policyFile, "policy", "", "required: authorization policy file (YAML): which SPIFFE IDs may register, dial and administer")
	fs.DurationVar(&c.DialTimeout, "dial-timeout", admission.DefaultTimeout, "how long a dial may wait for its agent")
	fs.DurationVar(&c.StartupGrace, "startup-grace", server.DefaultStartupGrace, "a new replica is ready once its agents have registered (none for 3s), or this long after it starts at the latest (negative: ready at once)")
	fs.DurationVar(&c.Grace, "grace", server.DefaultGrace, "on SIGTERM, how long tunnels in flight may still run")
	fs.DurationVar(&c.IdleTimeout, "idle-timeout", tunnel.DefaultIdleTimeout, "end tunnels that carry nothing for this long; must be positive (negative: never)")
	fs.Int64Var(&c.Limits.MaxPendingPerCluster, "max-pending-dials-per-cluster", registry.DefaultMaxPendingPerCluster, "dials one agent may have waiting for one logical cluster; other clusters' dials never count against it (0: no limit)")
	fs.Int64Var(&c.Limits.MaxTunnelsPerAgent, "max-tunnels-per-agent", registry.DefaultMaxTunnelsPerAgent, "tunnels one agent may carry, counting the pending dials of the cluster being dialed (0: no limit)")
	fs.Int64Var(&c.MaxTunnelsPerCaller, "max-tunnels-per-caller", admission.DefaultMaxTunnelsPerCaller, "tunnels one caller SPIFFE ID may hold, through Dial and CONNECT together (0: no limit)")
	fs.Int64Var(&c.MaxEarlyDataPerCaller, "max-early-data-per-caller", admission.DefaultMaxEarlyDataPerCaller, "bytes of early data one caller SPIFFE ID's pending dials may hold (0: no limit)")
	fs.Int64Var(&c.MaxEarlyData, "max-early-data", admission.DefaultMaxEarlyData, "bytes of early data all callers' pending dials may hold (0: no limit)")
	fs.IntVar(&c.MaxMessageSize, "max-message-size", server.DefaultMaxMessageSize, "largest gRPC message accepted, in bytes")
	fs.Int64Var(&c.MaxOpeningStreamsPerPeer, "max-opening-streams-per-peer", opening.DefaultMaxPerPeer, "streams one peer SPIFFE ID may have open that have not sent their first message (0: no limit)")
	fs.Int64Var(&c.MaxOpeningStreams, "max-opening-streams", opening.DefaultMaxTotal, "streams all peers together may have open that have not sent their first message (0: no limit)")
	maxStreams = fs.Uint("max-concurrent-streams", server.DefaultMaxConcurrentStreams, "streams one connection may have open (HTTP/2 MAX_CONCURRENT_STREAMS)")
	fs.Int64Var(&c.MaxRegistrationsPerAgent, "max-registrations-per-agent", agentv1.DefaultMaxRegistrations, "control streams (registrations) one agent SPIFFE ID may hold (0: no limit)")
	fs.Float64Var(&c.MaxReregistrationsPerSecond, "max-reregistrations-per-second", agentv1.DefaultMaxReregistrationsPerSecond, "changed cluster lists one control stream may put in force a second; a later list replaces one that waits (negative: no pace)")
	fs.IntVar(&c.MaxClustersPerRegistration, "max-clusters-per-registration", agentv1.DefaultMaxClusters, "logical clusters one registration may serve (0: no limit)")
	window = fs.Int("window-size", server.DefaultWindowSize, "HTTP/2 flow-control window per stream, in bytes, 65535 to 134217727; a connection's is 16 times it (negative: gRPC's dynamic windows)")
	fs.DurationVar(&c.ProbeEvery, "probe-interval", agentv1.DefaultProbeEvery, "how often each agent is probed over its control stream")
	fs.DurationVar(&c.HandshakeTimeout, "handshake-timeout", server.DefaultHandshakeTimeout, "how long a new connection may take to finish its TLS and HTTP/2 handshakes (on --egress-listen, its TLS handshake, within --dial-timeout)")
	fs.IntVar(&c.MaxHandshakes, "max-concurrent-handshakes", server.DefaultMaxHandshakes, "TLS handshakes in progress at once, on the gRPC port and on --egress-listen each; past it a stalled one (over 1s) is dropped, else the new connection is closed (0: no limit)")
	fs.DurationVar(&c.ExpiredPeerGrace, "expired-peer-grace", server.DefaultExpiredPeerGrace, "how long tunnels in flight may still run on a connection whose peer's SVID expired (new RPCs are refused at the expiry)")
	fs.DurationVar(&c.MaxConnectionAge, "max-connection-age", server.DefaultMaxConnectionAge, "how long a client may start RPCs on one connection before it is asked to reconnect (with its current SVID); keep it under half the SVID lifetime (negative: never)")
	fs.StringVar(&o.replicasDNS, "replicas-dns", "", "a DNS name that resolves to every replica from its start until it is gone, ready or not (a headless Service that publishes not-ready addresses): the broker counts them every 5s and tells its agents, so that agents that reach the replicas through one load balancer (their --broker-lb) know how many to find")
	fs.StringVar(&o.opsListen, "metrics-listen", ":9090", "address for /metrics, /healthz and /readyz (empty: off)")
	fs.BoolVar(&o.metricsPerCluster, "metrics-per-cluster", false, "export kcp_tunnel_broker_agents{cluster}, one series per logical cluster served (a scrape then copies the routing table under its lock)")
	fs.StringVar(&o.pprof, "pprof-listen", "", "address for /debug/pprof (empty: off; keep it on loopback)")
	o.tracing.AddFlags(fs)
	fs.BoolVar(&o.jsonLogs, "log-json", false, "log JSON lines instead of text")
	fs.BoolVar(&o.verbose, "v", false, "log every tunnel, not only failures")
	o.identity = identity.AddFlags(fs)
	o.egress.add(fs)
	fs.BoolVar(&o.showVersion, "version", false, "print the version and exit")
	return maxStreams, window
}

// noLimitIfZero turns each flag's 0 (no limit) into Config's (negative).
func noLimitIfZero[T int | int64](limits ...*T) {
	for _, v := range limits {
		if *v == 0 {
			*v = -1
		}
	}
}

// checkWindowSize refuses a --window-size gRPC would not take as given:
// below HTTP/2's initial window gRPC ignores it, and the connection's window
// (16 times the stream's) must fit HTTP/2's 2^31-1.
func checkWindowSize(w int) error {
	switch {
	case w < 0:
		return nil
	case w < server.MinWindowSize:
		return flagcheck.Errorf("--window-size %d: below %d, HTTP/2's initial window, gRPC would ignore it (negative: gRPC's dynamic windows)", w, server.MinWindowSize)
	case w > server.MaxWindowSize:
		return flagcheck.Errorf("--window-size %d: over %d: the connection's window, 16 times the stream's, must fit HTTP/2's 2^31-1 bytes", w, server.MaxWindowSize)
	}
	return nil
}

func hostname() string {
	h, _ := os.Hostname()
	return h
}
