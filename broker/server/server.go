// Package server assembles the broker's gRPC server: mTLS with SPIFFE, the
// dial and agent services, authorization, health and reflection, and the
// shutdown sequence that drains them.
package server

import (
	"cmp"
	"context"
	"log/slog"
	"math"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/reflection"
	"k8s.io/utils/clock"

	"github.com/kcp-dev/tunnel-broker/broker/admission"
	adminv1 "github.com/kcp-dev/tunnel-broker/broker/api/admin/v1"
	agentv1 "github.com/kcp-dev/tunnel-broker/broker/api/agent/v1"
	dialv1 "github.com/kcp-dev/tunnel-broker/broker/api/dial/v1"
	egressv1 "github.com/kcp-dev/tunnel-broker/broker/api/egress/v1"
	"github.com/kcp-dev/tunnel-broker/broker/authz"
	"github.com/kcp-dev/tunnel-broker/broker/internal/fragments"
	"github.com/kcp-dev/tunnel-broker/broker/internal/opening"
	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/broker/registry"
	"github.com/kcp-dev/tunnel-broker/broker/replicas"
	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
	"github.com/kcp-dev/tunnel-broker/internal/coalesce"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// Defaults of Config for what the server itself bounds; the services'
// defaults are in their packages (dial, agent, registry, tunnel, opening).
const (
	DefaultGrace = 20 * time.Second
	// DefaultMaxMessageSize fits the largest message any sender of the
	// protocol makes (wire.MaxMessageSize). It bounds what an unfinished
	// message can make gRPC hold (package opening).
	DefaultMaxMessageSize = wire.MaxMessageSize
	// DefaultMaxConcurrentStreams bounds the streams of one connection,
	// above --max-tunnels-per-caller (20000) so that kcp holds every
	// tunnel it may on one connection; a gRPC client queues the streams
	// past it.
	DefaultMaxConcurrentStreams = 25000
	// MaxHeaderListSize bounds the headers of a stream, which gRPC keeps
	// for the stream's life; what gRPC will make its default. A tunnel's
	// headers take a few hundred bytes.
	MaxHeaderListSize = 8 << 10
	// DefaultHandshakeTimeout bounds a connection's TLS and HTTP/2
	// handshakes, like Go's http.Transport TLSHandshakeTimeout (gRPC's own
	// default is 120 s).
	DefaultHandshakeTimeout = 10 * time.Second
	// DefaultMaxHandshakes bounds the TLS handshakes in progress: about
	// 12 KiB and a file descriptor each.
	DefaultMaxHandshakes = 1024
	// DefaultExpiredPeerGrace is how long RPCs in flight (tunnels) may
	// still run on a connection whose peer's SVID has expired.
	DefaultExpiredPeerGrace = 30 * time.Second
	// DefaultMaxConnectionAge is how long a client may start RPCs on one
	// connection before the broker asks it (HTTP/2 GOAWAY) to start new
	// ones on a new connection. A connection keeps the SVID of its
	// handshake, and RPCs of an expired one are refused; clients that
	// reconnect every 10 minutes (gRPC adds a random tenth either way)
	// present an SVID that SPIRE rotated at half its lifetime, long before
	// it expires, as long as SVIDs live more than 2 x 11 minutes. RPCs in
	// flight, tunnels and control streams, run on.
	DefaultMaxConnectionAge = 10 * time.Minute
	// DefaultWindowSize is the fixed per-stream window kcp and the agent
	// use too (wire.WindowSize).
	DefaultWindowSize = wire.WindowSize
	// MinWindowSize and MaxWindowSize bound a fixed window: gRPC ignores
	// one below HTTP/2's initial window (65535 bytes), and a connection's
	// window, 16 times a stream's (wire.ServerOptions), must fit HTTP/2's
	// 2^31-1.
	MinWindowSize = 65535
	MaxWindowSize = math.MaxInt32 / 16
)

// Config is what a broker replica needs. As in every Config of the broker,
// a zero value means the default. A negative value means none where a bound
// may be off: no limit, never (IdleTimeout, MaxConnectionAge), gRPC's
// dynamic windows (WindowSize); for the bounds that may not be off
// (DialTimeout, HandshakeTimeout, ExpiredPeerGrace), it means the default.
type Config struct {
	// ID names this replica to agents and in logs.
	ID string
	// Identity is the broker's SVID and the bundles it trusts.
	Identity identity.SVIDSource
	// Policy says which SPIFFE IDs may do what.
	Policy *policy.Policy
	// DialTimeout bounds a dial (admission.DefaultTimeout), and every
	// stream's first message.
	DialTimeout time.Duration
	// Grace is how long tunnels in flight may run once shutdown begins
	// (DefaultGrace).
	Grace time.Duration
	// IdleTimeout ends tunnels that carry nothing for so long
	// (tunnel.DefaultIdleTimeout).
	IdleTimeout time.Duration
	// Limits bound each agent (registry.Limits); MaxTunnelsPerCaller each
	// caller identity, through the Dial RPC and the CONNECT front ends
	// together (admission.DefaultMaxTunnelsPerCaller).
	Limits              registry.Limits
	MaxTunnelsPerCaller int64
	// MaxEarlyDataPerCaller and MaxEarlyData bound the early data pending
	// dials hold, per caller and in all (admission.DefaultMaxEarlyData...).
	MaxEarlyDataPerCaller, MaxEarlyData int64
	// MaxMessageSize bounds a received message (DefaultMaxMessageSize).
	MaxMessageSize int
	// MaxOpeningStreamsPerPeer and MaxOpeningStreams bound the streams
	// that have not sent their first message yet, per peer SPIFFE ID and
	// in total (package opening's defaults).
	MaxOpeningStreamsPerPeer, MaxOpeningStreams int64
	// MaxConcurrentStreams bounds the streams of one connection
	// (DefaultMaxConcurrentStreams).
	MaxConcurrentStreams uint32
	// MaxRegistrationsPerAgent bounds the control streams of one agent
	// SPIFFE ID, MaxClustersPerRegistration the clusters one registration
	// may serve, and ProbeEvery is how often agents are probed (package
	// agent's defaults).
	MaxRegistrationsPerAgent   int64
	MaxClustersPerRegistration int
	ProbeEvery                 time.Duration
	// MaxReregistrationsPerSecond paces each control stream's
	// re-registrations, the latest list winning (package agent's default;
	// negative: no pace).
	MaxReregistrationsPerSecond float64
	// WindowSize is the HTTP/2 flow-control window of each stream
	// (DefaultWindowSize).
	WindowSize int32
	// HandshakeTimeout bounds each connection's handshakes
	// (DefaultHandshakeTimeout).
	HandshakeTimeout time.Duration
	// MaxHandshakes bounds the TLS handshakes in progress
	// (DefaultMaxHandshakes).
	MaxHandshakes int
	// ExpiredPeerGrace is how long a connection whose peer's SVID expired
	// stays open for its RPCs in flight (DefaultExpiredPeerGrace).
	ExpiredPeerGrace time.Duration
	// StartupGrace is how long after its start a replica that no agent
	// joins waits before it is ready (DefaultStartupGrace; negative: ready
	// at once).
	StartupGrace time.Duration
	// MaxConnectionAge is how long a connection takes new RPCs
	// (DefaultMaxConnectionAge).
	MaxConnectionAge time.Duration
	// Replicas, if set, counts the replicas, and agents hear the count
	// (package replicas); the caller runs it.
	Replicas *replicas.Counter
	// Clock times what time decides in the services: the idle limit,
	// probes, first messages, registrations' SVID expiry; nil: the real
	// clock.
	Clock clock.WithTickerAndDelayedExecution
	Log   *slog.Logger
}

// withDefaults is cfg with the server's own defaults resolved; the services
// resolve theirs.
func (cfg Config) withDefaults() Config {
	cfg.DialTimeout = cmp.Or(max(cfg.DialTimeout, 0), admission.DefaultTimeout)
	cfg.Grace = cmp.Or(cfg.Grace, DefaultGrace)
	cfg.MaxMessageSize = cmp.Or(cfg.MaxMessageSize, DefaultMaxMessageSize)
	cfg.MaxConcurrentStreams = cmp.Or(cfg.MaxConcurrentStreams, DefaultMaxConcurrentStreams)
	cfg.WindowSize = cmp.Or(cfg.WindowSize, DefaultWindowSize)
	cfg.HandshakeTimeout = cmp.Or(max(cfg.HandshakeTimeout, 0), DefaultHandshakeTimeout)
	cfg.MaxHandshakes = cmp.Or(cfg.MaxHandshakes, DefaultMaxHandshakes)
	cfg.ExpiredPeerGrace = cmp.Or(max(cfg.ExpiredPeerGrace, 0), DefaultExpiredPeerGrace)
	cfg.MaxConnectionAge = cmp.Or(cfg.MaxConnectionAge, DefaultMaxConnectionAge)
	cfg.StartupGrace = cmp.Or(cfg.StartupGrace, DefaultStartupGrace)
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	cfg.Log = cmp.Or(cfg.Log, slog.Default())
	return cfg
}

// Server is one broker replica.
type Server struct {
	cfg       Config
	grpc      *grpc.Server
	health    *health.Server
	admission *admission.Admission
	draining  context.Context // ends when the replica stops taking dials
	drain     context.CancelFunc
	stopping  context.Context // ends when the grace period is over
	stop      context.CancelFunc
	Registry  *registry.Registry
	// Tunnels are the tunnels open through the replica.
	Tunnels *tunnel.Table
	// started is when the replica was made; settled is true once its
	// agents have arrived (readiness.go).
	started time.Time
	settled atomic.Bool
}

// New builds a broker replica; Serve starts it.
func New(cfg Config) *Server {
	cfg = cfg.withDefaults()
	s := &Server{cfg: cfg, Registry: registry.New(cfg.Limits), Tunnels: tunnel.NewTable(), health: health.NewServer(), started: time.Now()}
	s.draining, s.drain = context.WithCancel(context.Background())
	s.stopping, s.stop = context.WithCancel(context.Background())
	// Every stream must send its first message within the dial timeout,
	// and only so many may be waiting for theirs.
	guard := opening.New(opening.Config{
		Timeout:    cfg.DialTimeout,
		MaxPerPeer: cfg.MaxOpeningStreamsPerPeer,
		MaxTotal:   cfg.MaxOpeningStreams,
		First: map[string]string{
			tunnelv1.DialService_Dial_FullMethodName:     "target",
			tunnelv1.AgentService_Tunnel_FullMethodName:  "open",
			tunnelv1.AgentService_Connect_FullMethodName: "register",
		},
		Clock: cfg.Clock,
		Log:   cfg.Log,
	})
	// One front door for the Dial RPC and the CONNECT front ends.
	s.admission = admission.New(admission.Config{
		Registry: s.Registry, Policy: cfg.Policy, Timeout: cfg.DialTimeout,
		MaxTunnelsPerCaller:   cfg.MaxTunnelsPerCaller,
		MaxEarlyDataPerCaller: cfg.MaxEarlyDataPerCaller, MaxEarlyData: cfg.MaxEarlyData,
		Tunnels:  tunnel.Config{IdleTimeout: cfg.IdleTimeout, Stopping: s.stopping, Clock: cfg.Clock, Table: s.Tunnels},
		Draining: s.draining,
		BrokerID: cfg.ID,
		Log:      cfg.Log.With("component", "dial"),
	})
	s.grpc = grpc.NewServer(s.serverOptions(guard)...)
	s.registerServices()
	guard.Methods(s.grpc)
	return s
}

// credentials are the server's transport credentials: SPIFFE mTLS, with
// its bounds on handshakes and on peers whose SVID has expired.
func (s *Server) credentials() credentials.TransportCredentials {
	cfg := s.cfg
	// The handshake admits any SVID that chains to a trusted bundle; the
	// policy then decides per RPC, so a refused peer gets PermissionDenied,
	// not a bare TLS alert.
	opts := append(s.handshakeBounds(cfg.Log), identity.CloseExpiredPeers(cfg.ExpiredPeerGrace))
	creds := identity.ServerCredentials(cfg.Identity, tlsconfig.AuthorizeAny(), opts...)
	// One write syscall per gRPC flush, not one per 16 KiB TLS record.
	creds = coalesce.Writes(creds)
	// A peer that sends its data in tiny or padded DATA frames would make
	// gRPC hold some 40 times what it sends; its connection is closed.
	return fragments.Refuse(creds, fragments.Report{Log: cfg.Log, Count: metrics.ClosedFragmented.Inc})
}

// handshakeBounds bound a TLS listener's handshakes in progress
// (MaxHandshakes, each listener its own; a stalled one gives way), and
// count those that fail and log them, sparingly, to log. The gRPC port and
// the CONNECT front end on TCP both have them, and HandshakeTimeout.
func (s *Server) handshakeBounds(log *slog.Logger) []identity.Option {
	return []identity.Option{
		identity.ReportRefusals(&identity.Refusals{Log: log, Count: metrics.CountRefusedHandshake}),
		identity.MaxConcurrentHandshakes(s.cfg.MaxHandshakes),
	}
}

// serverOptions are the gRPC server's interceptors, in the order they run,
// and its transport settings.
func (s *Server) serverOptions(guard *opening.Guard) []grpc.ServerOption {
	cfg := s.cfg
	opts := []grpc.ServerOption{
		// RPC metrics first, so that refused RPCs are counted too.
		grpc.ChainUnaryInterceptor(metrics.GRPC.UnaryServerInterceptor()),
		grpc.ChainStreamInterceptor(metrics.StreamServerInterceptor()),
	}
	// A peer whose SVID has expired is refused before the policy is asked,
	// and one the policy refuses before it counts against the opening
	// streams' bounds.
	opts = append(opts, identity.ExpiryInterceptors()...)
	opts = append(opts, (&authz.Authorizer{Policy: cfg.Policy, Log: cfg.Log}).ServerOptions()...)
	opts = append(opts, guard.ServerOptions()...)
	opts = append(opts,
		grpc.MaxConcurrentStreams(cfg.MaxConcurrentStreams),
		grpc.MaxHeaderListSize(MaxHeaderListSize),
		grpc.Creds(s.credentials()),
		grpc.ConnectionTimeout(cfg.HandshakeTimeout),
		grpc.MaxRecvMsgSize(cfg.MaxMessageSize),
		// Agents ping to notice a dead broker quickly; allow it.
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 5 * time.Second, PermitWithoutStream: true}),
		// And the broker pings quiet peers, so a vanished agent is dropped
		// in seconds. Clients move to a new connection, with their current
		// SVID, every MaxConnectionAge; RPCs in flight are not cut short.
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: 10 * time.Second, Timeout: 5 * time.Second,
			MaxConnectionAge: max(cfg.MaxConnectionAge, 0)}),
	)
	// No read buffer of gRPC's own: crypto/tls already reads whole records,
	// and gRPC's 32 KiB buffer per connection was the largest item of an
	// idle agent's memory (docs/perf-history.md, the scale phase's first
	// run: RSS per agent 95-97 KiB with it, 75 KiB without; throughput and
	// CPU per GiB unchanged).
	opts = append(opts, grpc.ReadBufferSize(0))
	// The write buffer, Frame streams and windows kcp and the agent share.
	return append(opts, wire.ServerOptions(cfg.WindowSize)...)
}

// registerServices registers the broker's services, health and reflection.
func (s *Server) registerServices() {
	cfg := s.cfg
	dialv1.RegisterService(s.grpc, dialv1.New(dialv1.Config{Admission: s.admission}))
	agentv1.RegisterService(s.grpc, s.agentService())
	adminv1.RegisterService(s.grpc, adminv1.New(adminv1.Config{Registry: s.Registry, Tunnels: s.Tunnels, BrokerID: cfg.ID}))
	healthpb.RegisterHealthServer(s.grpc, s.health)
	reflection.Register(s.grpc)
	metrics.GRPC.InitializeMetrics(s.grpc)
}

// agentService is the replica's agent service.
func (s *Server) agentService() *agentv1.Service {
	cfg := s.cfg
	return agentv1.New(agentv1.Config{
		Registry: s.Registry, Policy: cfg.Policy, BrokerID: cfg.ID,
		Draining: s.draining, Stopping: s.stopping, Grace: cfg.Grace,
		ProbeEvery: cfg.ProbeEvery, RegistrationTimeout: cfg.DialTimeout,
		MaxRegistrations: cfg.MaxRegistrationsPerAgent, MaxClusters: cfg.MaxClustersPerRegistration,
		MaxReregistrationsPerSecond: cfg.MaxReregistrationsPerSecond,
		Replicas:                    s.replicas(),
		MaxConnectionAge:            max(cfg.MaxConnectionAge, 0),
		Clock:                       cfg.Clock,
		Log:                         cfg.Log.With("component", "agent"),
	})
}

// replicas is the count the agent service tells agents, if any (a nil
// *Counter in the interface would not be nil).
func (s *Server) replicas() interface {
	Count() (int, <-chan struct{})
} {
	if s.cfg.Replicas == nil {
		return nil
	}
	return s.cfg.Replicas
}

// EgressUDS is a plain CONNECT front end of this replica (package egress)
// for cluster, for a Unix socket whose file mode decides who connects.
// It admits its tunnels through the replica's front door, as the Dial RPC
// does: one quota per caller, the same limits, audit and listing; serve it
// with its Serve.
func (s *Server) EgressUDS(cluster string) *egressv1.Server {
	return s.egress(egressv1.Config{Name: "uds", Cluster: cluster})
}

// EgressTLS is a CONNECT front end with SPIFFE mTLS, the replica's SVID,
// and each caller's cluster from the policy; its TLS handshakes are
// bounded as the gRPC port's are (HandshakeTimeout, MaxHandshakes: a
// stalled one gives way to a new one), and a connection takes an opening
// place only once its peer is verified. Otherwise as EgressUDS.
func (s *Server) EgressTLS() *egressv1.Server {
	tlsServer := identity.NewTLSServer(s.cfg.Identity, s.handshakeBounds(s.egressLog())...)
	return s.egress(egressv1.Config{Name: "tls", TLS: tlsServer, HandshakeTimeout: s.cfg.HandshakeTimeout})
}

func (s *Server) egress(c egressv1.Config) *egressv1.Server {
	cfg := s.cfg
	c.Admission, c.Policy, c.Timeout = s.admission, cfg.Policy, cfg.DialTimeout
	c.Log = s.egressLog()
	return egressv1.New(c)
}

func (s *Server) egressLog() *slog.Logger {
	return s.cfg.Log.With("service", "egress")
}

// active is the number of tunnels the replica splices, Dial's and the
// CONNECT front ends'.
func (s *Server) active() int64 { return s.admission.Active() }

// Serve serves on l until ctx ends, then shuts down: it stops taking dials
// and says so (health NOT_SERVING, agents told to drain), lets tunnels in
// flight run for the grace period, then ends them with Unavailable.
func (s *Server) Serve(ctx context.Context, l net.Listener) error {
	served := make(chan error, 1)
	go func() { served <- s.grpc.Serve(l) }()
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	s.shutdown()
	return <-served
}

// shutdown drains the replica. From its start, new dials are refused with
// a status that sends them to another replica; once the dials in progress
// are answered, gRPC's GOAWAY on every connection, and the listener's
// close, move clients' new RPCs to the other replicas, so that they stop
// sending dials here, while the streams open go on: tunnels, and agents'
// registrations. After the grace period, tunnels still open are ended.
func (s *Server) shutdown() {
	log := s.cfg.Log
	s.health.Shutdown()
	s.drain()
	log.Info("draining", "tunnels", s.active(), "grace", s.cfg.Grace)
	deadline := time.NewTimer(s.cfg.Grace)
	defer deadline.Stop()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	stopped := make(chan struct{})
	var goingAway sync.Once
	goAway := func() {
		goingAway.Do(func() { go func() { s.grpc.GracefulStop(); close(stopped) }() })
	}
wait:
	for s.active() > 0 || s.admission.Dialing() > 0 {
		// A dial in progress needs its agent's Tunnel stream, which a
		// GOAWAY would refuse: it goes out once none is left.
		if s.admission.Dialing() == 0 {
			goAway()
		}
		select {
		case <-deadline.C:
			break wait
		case <-tick.C:
		}
	}
	goAway()
	if n := s.active(); n > 0 {
		log.Info("grace period over, ending tunnels", "tunnels", n)
	}
	s.stop()
	// Every handler now returns promptly; GracefulStop lets their statuses
	// reach the peers before the connections close.
	select {
	case <-stopped:
	case <-time.After(5 * time.Second):
		s.grpc.Stop()
	}
}

// Stop ends the replica at once, as a crash would for its peers.
func (s *Server) Stop() { s.grpc.Stop() }
