// Package egress serves the broker's HTTP CONNECT front end: the egress
// protocol of kube-apiserver's EgressSelectorConfiguration
// (proxyProtocol: HTTPConnect), over a Unix socket or TCP with SPIFFE mTLS,
// so that any API server reaches the Services of one logical cluster
// through the broker and an agent, as Konnectivity's users do, without a
// change to the API server.
//
// One connection is one CONNECT host:port and, after the 200, one tunnel,
// admitted through the broker's one front door (package admission) as a
// Dial's is: the same quota per caller, dial, agent leg, limits, metrics,
// audit line and listing; the connection is the tunnel's caller leg
// (tunnel.ConnLeg). A CONNECT names no cluster: a Unix socket's front end
// serves the one cluster it was configured with, and a TLS caller goes to
// the cluster of its SPIFFE ID's egress rule in the policy.
package egress

import (
	"cmp"
	"context"
	"errors"
	"log/slog"
	"net"
	"sync"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/kcp-dev/tunnel-broker/broker/admission"
	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
)

// Frontend names the CONNECT front ends in the front door's metrics, logs
// and audit lines.
const Frontend = "CONNECT"

// Defaults of Config.
const (
	// DefaultTimeout bounds a connection from its accept to its 200: the
	// TLS handshake, the request head and the dial.
	DefaultTimeout = 5 * time.Second
	// DefaultMaxHeaderBytes bounds a request head; kube-apiserver's is a
	// request line and a Host header.
	DefaultMaxHeaderBytes = 4 << 10
	// DefaultMaxOpening bounds the connections that have not had their
	// answer yet, of a TLS front end those whose peer is verified; past it
	// a new connection is closed at once.
	DefaultMaxOpening = 128
)

// Config is one front end. A zero value means the default, and a negative
// limit none.
type Config struct {
	// Name labels the front end's metrics and logs: "uds" or "tls".
	Name string
	// TLS, if set, is the server side of SPIFFE mTLS
	// (identity.NewTLSServer), which bounds the handshakes in progress;
	// nil serves plain connections, for a Unix socket whose file
	// permissions decide who may connect.
	TLS *identity.TLSServer
	// Cluster is the logical cluster of every connection of a plain front
	// end; a TLS front end takes each caller's from Policy.EgressCluster.
	Cluster string
	// Admission is the broker's front door, which it shares with the Dial
	// RPC; Policy names each TLS caller's cluster.
	Admission *admission.Admission
	Policy    *policy.Policy
	// Timeout bounds a connection until its answer (DefaultTimeout).
	Timeout time.Duration
	// HandshakeTimeout bounds the TLS handshake, from the accept, within
	// Timeout (zero: Timeout).
	HandshakeTimeout time.Duration
	MaxHeaderBytes   int // DefaultMaxHeaderBytes
	MaxOpening       int // DefaultMaxOpening
	Log              *slog.Logger
}

// Server is one CONNECT front end.
type Server struct {
	cfg     Config
	opening chan struct{} // a token per connection without its answer
	conns   sync.WaitGroup
}

// New is a front end with cfg, its defaults resolved.
func New(cfg Config) *Server {
	cfg.Name = cmp.Or(cfg.Name, "uds")
	cfg.Timeout = cmp.Or(max(cfg.Timeout, 0), DefaultTimeout)
	cfg.HandshakeTimeout = min(cmp.Or(max(cfg.HandshakeTimeout, 0), cfg.Timeout), cfg.Timeout)
	cfg.MaxHeaderBytes = cmp.Or(max(cfg.MaxHeaderBytes, 0), DefaultMaxHeaderBytes)
	cfg.MaxOpening = cmp.Or(cfg.MaxOpening, DefaultMaxOpening)
	cfg.Log = cmp.Or(cfg.Log, slog.Default()).With("frontend", cfg.Name)
	s := &Server{cfg: cfg}
	if cfg.MaxOpening > 0 {
		s.opening = make(chan struct{}, cfg.MaxOpening)
	}
	return s
}

// Serve serves connections from l until ctx ends or l fails, and returns
// once every connection it took has ended (tunnels end with
// Config.Tunnels.Stopping).
func (s *Server) Serve(ctx context.Context, l net.Listener) error {
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()
	defer s.conns.Wait()
	for {
		conn, err := l.Accept()
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return nil
			}
			var temporary interface{ Timeout() bool }
			if errors.As(err, &temporary) && temporary.Timeout() {
				continue
			}
			return err
		}
		// A plain front end's peers are vouched for by the socket's file
		// mode, and wait in an opening place from their accept; a TLS
		// front end's take one once verified (handshake).
		if s.cfg.TLS == nil && !s.takeOpening() {
			noOpening()
			conn.Close()
			continue
		}
		s.conns.Add(1)
		go func() {
			defer s.conns.Done()
			s.serveConn(conn)
		}()
	}
}

func (s *Server) takeOpening() bool {
	if s.opening == nil {
		return true
	}
	select {
	case s.opening <- struct{}{}:
		return true
	default:
		return false
	}
}

// noOpening counts a connection closed because no opening place was free.
func noOpening() { metrics.LimitsHit.WithLabelValues("egress_opening").Inc() }

func (s *Server) releaseOpening() {
	if s.opening != nil {
		<-s.opening
	}
}

// caller is who sent a connection: the SPIFFE ID of a TLS peer, zero on a
// plain front end, and the cluster its connections go to.
type caller struct {
	id      spiffeid.ID
	cluster string
}

func (c caller) String() string { return c.admitted().String() }

// admitted is the caller as the front door counts it: the front end's
// cluster is the policy's answer already.
func (c caller) admitted() admission.Caller {
	return admission.Caller{ID: c.id, Frontend: Frontend, Authorized: true}
}

// errNoOpening is a verified connection for which no opening place was free.
var errNoOpening = errors.New("too many connections waiting for their answer")

// handshake finishes the TLS handshake of a TLS front end, within
// HandshakeTimeout of accepted, among the handshakes in progress that TLS
// bounds, and then takes the connection's opening place (a plain front
// end's took its at the accept); deadline is the connection's from then
// on. It says whose connection conn is; TLS reports a failed handshake
// (identity.Refusals).
func (s *Server) handshake(conn net.Conn, accepted, deadline time.Time) (net.Conn, caller, error) {
	if s.cfg.TLS == nil {
		return conn, caller{cluster: s.cfg.Cluster}, nil
	}
	_ = conn.SetDeadline(accepted.Add(s.cfg.HandshakeTimeout))
	tc, info, err := s.cfg.TLS.Handshake(conn)
	if err != nil {
		return nil, caller{}, err
	}
	_ = conn.SetDeadline(deadline)
	if !s.takeOpening() {
		return nil, caller{}, errNoOpening
	}
	return tc, caller{id: info.ID}, nil
}
