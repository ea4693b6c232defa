// Package agent is the syncer agent's side of the tunnel: it keeps a control
// stream to each broker replica, and for each dial order connects to the
// target its Resolver names and pipes bytes over a Tunnel stream of its own.
package agent

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"google.golang.org/grpc"
	grpcbackoff "google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"
	"k8s.io/utils/clock"

	"github.com/kcp-dev/tunnel-broker/internal/coalesce"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
)

// DefaultGrace is how long tunnels in flight may run once the agent drains.
const DefaultGrace = 20 * time.Second

// Agent serves one broker replica's address. A Fleet runs one per replica.
type Agent struct {
	// Broker is the replica's host:port.
	Broker string
	// Credentials are the agent's SPIFFE mTLS credentials.
	Credentials credentials.TransportCredentials
	// SVID, if set, is the SVID the credentials present: when the broker
	// cannot be reached, the agent checks it before blaming the network
	// (ownProblem).
	SVID x509svid.Source
	// StalledWriteTimeout ends a tunnel whose target takes no byte of a
	// write for so long (zero: DefaultStalledWriteTimeout). The copier
	// blocked in that write does not see the broker end the tunnel, so
	// nothing else would free it.
	StalledWriteTimeout time.Duration
	// Name is shown in the broker's logs and listings.
	Name     string
	Resolver lookup.Resolver
	// Grace is how long tunnels in flight may run once Run's ctx ends.
	Grace time.Duration
	Log   *slog.Logger
	// ReconnectMaxDelay is the ceiling of the waits between attempts to
	// reach the broker (zero: DefaultReconnectMaxDelay). It bounds how long
	// after a broker is back the agent registers again, whatever the length
	// of the outage.
	ReconnectMaxDelay time.Duration
	// Clock times the waits between registrations, the grace period and
	// the wait for the broker to end a registration; nil means the real
	// clock.
	Clock clock.Clock

	// Registered, if set, is called each time the broker accepts the agent.
	Registered func(brokerID string)
	// Replicas, if set, is called with each count of replicas the broker
	// sends (tunnelv1.Replicas).
	Replicas func(count int)
	// OneConnection: Broker is one address in front of every replica (a
	// load balancer), where each new connection may reach another
	// replica. The agent then keeps to its first connection, on which its
	// control stream and every Tunnel stream reach the same replica: once
	// it has been ready it dials no other, and when it is lost or the broker
	// asks for a new one (GOAWAY, --max-connection-age), the agent drains
	// and Run returns.
	OneConnection bool
	// Retiring, if set, is called once, with OneConnection, when the
	// connection nears the age at which the broker will ask for a new one
	// (Registered.max_connection_age): a fleet then finds the replica on a
	// new connection, and lets this one go, before the broker asks.
	Retiring func()

	registered atomic.Bool
	dialOnce   *dialOnce // with OneConnection
	// lastFailure says why the last session ended or failed to start.
	lastFailure atomic.Pointer[string]
}

// IsRegistered reports whether the broker holds the agent's registration now.
func (a *Agent) IsRegistered() bool { return a.registered.Load() }

// notRegistered says which broker the agent is not registered with, and why.
func (a *Agent) notRegistered() string {
	if why := a.lastFailure.Load(); why != nil {
		return a.Broker + ": " + *why
	}
	return a.Broker + ": connecting"
}

// ownProblem says, in the agent's words, what is wrong with its own SVID
// when reaching or registering with the broker failed with err: it has
// expired, or the broker refused it. Empty if neither.
func (a *Agent) ownProblem(err error) string {
	p, ok := identity.DiagnoseOwn(a.SVID, err, a.clock().Now())
	switch {
	case !ok:
		return ""
	case p.Expired:
		return fmt.Sprintf("my SVID expired at %s and no new one has come: is the SPIRE agent (--spiffe-socket) running, or whatever renews --svid-cert?",
			p.NotAfter.UTC().Format(time.RFC3339))
	case p.PeerAlert == "expired certificate":
		return fmt.Sprintf("the broker refused my certificate as expired, but my SVID is valid until %s: is the broker's clock or this host's wrong?",
			p.NotAfter.UTC().Format(time.RFC3339))
	}
	shown := "TLS alert: " + p.PeerAlert
	if !p.ID.IsZero() {
		shown = p.ID.String() + ", " + shown
	}
	return fmt.Sprintf("the broker refused my certificate (%s): is my trust domain's CA in the broker's bundle (or --federated-bundle)? The broker's log says why", shown)
}

func (a *Agent) clock() clock.Clock {
	if a.Clock == nil {
		return clock.RealClock{}
	}
	return a.Clock
}

func (a *Agent) stalledWriteTimeout() time.Duration {
	return cmp.Or(a.StalledWriteTimeout, DefaultStalledWriteTimeout)
}

func (a *Agent) reconnectMaxDelay() time.Duration {
	return cmp.Or(max(a.ReconnectMaxDelay, 0), DefaultReconnectMaxDelay)
}

func (a *Agent) grace() time.Duration {
	if a.Grace <= 0 {
		return DefaultGrace
	}
	return a.Grace
}

// Run keeps the agent registered with the broker, reconnecting with
// exponential backoff and jitter (see reconnect), until ctx ends. Then it drains: it tells
// the broker to route it no new dials, refuses orders that still come, lets
// tunnels in flight run for Grace, and cancels what is left.
func (a *Agent) Run(ctx context.Context) error {
	conn, err := a.dial()
	if err != nil {
		return err
	}
	defer conn.Close()
	r := a.newRun(ctx, conn)
	defer r.end()
	sessionsOver := make(chan struct{})
	go func() {
		defer close(sessionsOver)
		r.reconnect()
	}()
	select {
	case <-ctx.Done():
	case <-a.connectionGone(ctx, conn):
		a.Log.Info("connection to the broker gone, draining it", "broker", a.Broker)
	}
	r.drain()
	<-sessionsOver
	return nil
}

// dial makes the agent's one gRPC connection to its broker replica.
func (a *Agent) dial() (*grpc.ClientConn, error) {
	if a.OneConnection {
		a.dialOnce = &dialOnce{}
	}
	// The transport settings kcp and the broker use too: coalesced
	// writes, the write buffer and fixed windows (package wire).
	// One write syscall per gRPC flush, not one per 16 KiB TLS record.
	opts := append(wire.DialOptions(coalesce.Writes(a.Credentials)),
		// Ping every 5s, give up after 5s more: a broker that vanished
		// without a word is noticed in about ten seconds.
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: 5 * time.Second, Timeout: 5 * time.Second, PermitWithoutStream: true}),
		// gRPC's reconnection backoff is the only wait between attempts to
		// connect (session waits for a ready connection; it adds none),
		// and its ceiling is a few seconds: the agent is back about that
		// long after its broker, however long the broker was gone. The
		// jitter spreads thousands of agents over a fifth of it either
		// way; the broker paces their registrations.
		grpc.WithConnectParams(ReconnectParams(a.reconnectMaxDelay())))
	if a.dialOnce != nil {
		opts = append(opts, grpc.WithContextDialer(a.dialOnce.dial))
	}
	return grpc.NewClient(a.Broker, opts...)
}

// ReconnectParams are how an agent's connection to a replica comes back:
// gRPC's backoff from 250ms up to maxDelay, with jitter, each attempt
// bounded by 3s. Simulated agents (test/bench) reconnect with them too.
func ReconnectParams(maxDelay time.Duration) grpc.ConnectParams {
	return grpc.ConnectParams{
		Backoff:           grpcbackoff.Config{BaseDelay: minRetry, Multiplier: 1.6, Jitter: 0.2, MaxDelay: maxDelay},
		MinConnectTimeout: connectTimeout,
	}
}

// agentRun is one Run of an agent: what its sessions and tunnels share.
type agentRun struct {
	*Agent
	client tunnelv1.AgentServiceClient
	// ctx ends when the run is over: after Run's ctx ended, once every
	// tunnel has finished or the grace period has run out. Sessions and
	// tunnels use it, so that tunnels in flight outlive Run's ctx.
	ctx context.Context
	end context.CancelFunc
	// draining is closed when Run's ctx ends, before ctx: from then on
	// the agent starts no tunnel.
	draining chan struct{}
	// admitting orders the start of a tunnel against the start of the
	// drain, so that no tunnel is added once the drain waits for them.
	admitting sync.Mutex
	tunnels   sync.WaitGroup
}

func (a *Agent) newRun(ctx context.Context, conn *grpc.ClientConn) *agentRun {
	ctx, end := context.WithCancel(context.WithoutCancel(ctx))
	return &agentRun{
		Agent:    a,
		client:   tunnelv1.NewAgentServiceClient(conn),
		ctx:      ctx,
		end:      end,
		draining: make(chan struct{}),
	}
}

// DefaultReconnectMaxDelay is the default ceiling of the waits between
// attempts to reach the broker (Agent.ReconnectMaxDelay).
const DefaultReconnectMaxDelay = 2 * time.Second

// Waits between attempts: exponential with jitter from minRetry up to
// ReconnectMaxDelay; slower when the broker's policy refused the agent,
// which only its operator can fix. connectTimeout bounds one attempt to
// connect, handshakes included, so that an attempt lost in a network
// partition gives way to a new one soon after the partition heals.
const (
	minRetry        = 250 * time.Millisecond
	connectTimeout  = 3 * time.Second
	minRefusedRetry = 30 * time.Second
	maxRefusedRetry = 5 * time.Minute
)

// reconnect runs one session after another until the agent drains. Between
// sessions on a connection that works it waits as its backoff says; while
// there is no connection, gRPC's reconnection backoff is the only wait (see
// session). Every attempt that fails is logged with its cause, and counted.
func (r *agentRun) reconnect() {
	retry := newBackoff(minRetry, r.reconnectMaxDelay())
	refusedRetry := newBackoff(minRefusedRetry, maxRefusedRetry)
	for {
		registered, err := r.session()
		// A session also ends when the run does, which is after the
		// drain began.
		select {
		case <-r.draining:
			return
		default:
		}
		if registered {
			retry.reset()
			refusedRetry.reset()
		}
		problem := r.ownProblem(err)
		why := err.Error()
		if problem != "" {
			why = problem + " (" + why + ")"
		}
		r.lastFailure.Store(&why)
		reconnects.Inc()
		wait := r.logFailure(err, problem, registered, retry, refusedRetry)
		if !r.sleep(wait) {
			return
		}
	}
}

// logFailure logs why a session failed or ended, and returns how long to
// wait before the next attempt. problem, if not empty, is what is wrong
// with the agent's own SVID (ownProblem): it is what the line says, at
// ERROR, as only the agent's operator can fix it.
func (r *agentRun) logFailure(err error, problem string, registered bool, retry, refusedRetry *backoff) time.Duration {
	level, msg := slog.LevelWarn, "cannot register with the broker"
	if registered {
		msg = "registration with the broker lost"
	}
	var unreachable *unreachableError
	var wait time.Duration
	switch {
	case errors.As(err, &unreachable):
		// gRPC waits between the attempts to connect: no wait of ours.
		msg = "cannot reach the broker, still trying"
	case status.Code(err) == codes.PermissionDenied && problem == "":
		level, msg = slog.LevelError, "the broker's policy refuses this agent: its SPIFFE ID must be listed under agents in the broker's --policy, bound to every cluster it serves"
		wait = refusedRetry.next()
	default:
		wait = retry.next()
	}
	if problem != "" {
		level, msg = slog.LevelError, problem
	}
	attrs := []any{"broker", r.Broker}
	if unreachable != nil {
		attrs = append(attrs, "error", unreachable.err, "waited", unreachable.waited.String())
	} else {
		attrs = append(attrs, "error", err, "retry_in", wait.Round(time.Millisecond).String(), "retry_at", r.clock().Now().Add(wait).Format(time.RFC3339))
	}
	r.Log.Log(context.Background(), level, msg, attrs...)
	return wait
}

// sleep waits d, unless the agent drains first; it reports whether it
// waited all of d.
func (r *agentRun) sleep(d time.Duration) bool {
	if d <= 0 {
		return true
	}
	timer := r.clock().NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C():
		return true
	case <-r.draining:
		return false
	}
}

// admit counts a new tunnel, unless the agent drains.
func (r *agentRun) admit() bool {
	r.admitting.Lock()
	defer r.admitting.Unlock()
	select {
	case <-r.draining:
		return false
	default:
		r.tunnels.Add(1)
		return true
	}
}

// drain starts no more tunnels, lets those in flight run for the grace
// period, then ends the run and waits for the tunnels to return.
func (r *agentRun) drain() {
	r.admitting.Lock()
	close(r.draining)
	r.admitting.Unlock()
	finished := make(chan struct{})
	go func() {
		r.tunnels.Wait()
		close(finished)
	}()
	timer := r.clock().NewTimer(r.grace())
	select {
	case <-finished:
	case <-timer.C():
		r.Log.Info("grace period over, ending tunnels", "broker", r.Broker)
	}
	timer.Stop()
	r.end()
	<-finished
}
