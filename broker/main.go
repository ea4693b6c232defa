// Command broker terminates agents' control and tunnel streams and serves
// kcp's Dial RPC, all over SPIFFE mTLS.
package main

import (
	"context"
	"flag"
	"fmt"
	"math"
	"net"
	"os"
	"os/signal"
	"syscall"

	agentv1 "github.com/kcp-dev/tunnel-broker/broker/api/agent/v1"
	dialv1 "github.com/kcp-dev/tunnel-broker/broker/api/dial/v1"
	"github.com/kcp-dev/tunnel-broker/broker/internal/abortable"
	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/broker/registry"
	"github.com/kcp-dev/tunnel-broker/broker/server"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	"github.com/kcp-dev/tunnel-broker/internal/ops"
	"github.com/kcp-dev/tunnel-broker/internal/version"
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
		grace      = flag.Duration("grace", server.DefaultGrace, "on SIGTERM, how long tunnels in flight may still run")
		idle       = flag.Duration("idle-timeout", server.DefaultIdleTimeout, "end tunnels that carry nothing for this long (negative: never)")
		maxPending = flag.Int64("max-pending-dials-per-cluster", 256, "dials one agent may have waiting for one logical cluster; other clusters' dials never count against it (0: no limit)")
		maxAgent   = flag.Int64("max-tunnels-per-agent", 20000, "tunnels one agent may carry, counting the pending dials of the cluster being dialed (0: no limit)")
		maxCaller  = flag.Int64("max-tunnels-per-caller", 20000, "tunnels one caller SPIFFE ID may hold (0: no limit)")
		maxMsg     = flag.Int("max-message-size", server.DefaultMaxMessageSize, "largest gRPC message accepted, in bytes")
		maxOpenID  = flag.Int64("max-opening-streams-per-peer", server.DefaultMaxOpeningStreamsPerPeer, "streams one peer SPIFFE ID may have open that have not sent their first message (0: no limit)")
		maxOpen    = flag.Int64("max-opening-streams", server.DefaultMaxOpeningStreams, "streams all peers together may have open that have not sent their first message (0: no limit)")
		maxStreams = flag.Uint("max-concurrent-streams", server.DefaultMaxConcurrentStreams, "streams one connection may have open (HTTP/2 MAX_CONCURRENT_STREAMS)")
		maxRegs    = flag.Int64("max-registrations-per-agent", agentv1.DefaultMaxRegistrations, "control streams (registrations) one agent SPIFFE ID may hold (0: no limit)")
		maxCl      = flag.Int("max-clusters-per-registration", agentv1.DefaultMaxClusters, "logical clusters one registration may serve (0: no limit)")
		window     = flag.Int("window-size", server.DefaultWindowSize, "HTTP/2 flow-control window per stream, in bytes (negative: gRPC's dynamic windows)")
		probe      = flag.Duration("probe-interval", agentv1.DefaultProbeEvery, "how often each agent is probed over its control stream")
		handshake  = flag.Duration("handshake-timeout", server.DefaultHandshakeTimeout, "how long a new connection may take to finish its TLS and HTTP/2 handshakes")
		handshakes = flag.Int("max-concurrent-handshakes", server.DefaultMaxHandshakes, "TLS handshakes in progress at once; past it a stalled one (over 1s) is dropped, else the new connection is closed (0: no limit)")
		expGrace   = flag.Duration("expired-peer-grace", server.DefaultExpiredPeerGrace, "how long tunnels in flight may still run on a connection whose peer's SVID expired (new RPCs are refused at the expiry)")
		connAge    = flag.Duration("max-connection-age", server.DefaultMaxConnectionAge, "how long a client may start RPCs on one connection before it is asked to reconnect (with its current SVID); keep it under half the SVID lifetime (negative: never)")
		opsListen  = flag.String("metrics-listen", ":9090", "address for /metrics, /healthz and /readyz (empty: off)")
		pprof      = flag.String("pprof-listen", "", "address for /debug/pprof (empty: off; keep it on loopback)")
		jsonLogs   = flag.Bool("log-json", false, "log JSON lines instead of text")
		verbose    = flag.Bool("v", false, "log every tunnel, not only failures")
		idOpts     = identity.AddFlags(flag.CommandLine)
		showVer    = flag.Bool("version", false, "print the version and exit")
	)
	flag.Parse()
	if *showVer {
		fmt.Println("broker", version.Get())
		return nil
	}

	log := ops.NewLogger(*jsonLogs, *verbose)
	if *policyFile == "" {
		return fmt.Errorf("--policy is required: the broker admits no one by default")
	}
	pol, err := policy.Load(*policyFile)
	if err != nil {
		return err
	}
	// Tunnels end from outside their handlers through a grpc-go method
	// outside its public API: make sure it works before serving, rather
	// than fail every Dial.
	if err := abortable.Check(context.Background()); err != nil {
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
		ID:                         *id,
		Identity:                   src,
		Policy:                     pol,
		DialTimeout:                *timeout,
		Grace:                      *grace,
		IdleTimeout:                *idle,
		Limits:                     registry.Limits{MaxPendingPerCluster: *maxPending, MaxTunnelsPerAgent: *maxAgent},
		MaxTunnelsPerCaller:        *maxCaller,
		MaxMessageSize:             *maxMsg,
		MaxOpeningStreamsPerPeer:   noLimitIfZero(*maxOpenID),
		MaxOpeningStreams:          noLimitIfZero(*maxOpen),
		MaxConcurrentStreams:       uint32(min(*maxStreams, math.MaxUint32)),
		MaxRegistrationsPerAgent:   noLimitIfZero(*maxRegs),
		MaxClustersPerRegistration: int(noLimitIfZero(int64(*maxCl))),
		ProbeEvery:                 *probe,
		WindowSize:                 int32(*window),
		HandshakeTimeout:           *handshake,
		MaxHandshakes:              *handshakes,
		ExpiredPeerGrace:           *expGrace,
		MaxConnectionAge:           *connAge,
		Log:                        log,
	})
	metrics.Registry.MustRegister(metrics.AgentsCollector{PerCluster: srv.Registry.AgentsPerCluster},
		version.Collector("kcp_tunnel_broker"))
	if err := ops.Serve(ctx, ops.Options{Listen: *opsListen, Pprof: *pprof, Ready: srv.Ready, Metrics: metrics.Registry}, log); err != nil {
		return err
	}
	log.Info("broker serving", "address", l.Addr().String(), "id", self.String(), "replica", *id, "version", version.Get().String())
	return srv.Serve(ctx, l)
}

// noLimitIfZero turns a flag's 0 (no limit) into the Config's (negative;
// there 0 means the default).
func noLimitIfZero(v int64) int64 {
	if v == 0 {
		return -1
	}
	return v
}

func hostname() string {
	h, _ := os.Hostname()
	return h
}
