// Package agent is the syncer agent's side of the tunnel: it keeps a control
// stream to each broker replica, and for each dial order connects to the
// target its Resolver names and pipes bytes over a Tunnel stream of its own.
package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"

	"github.com/kcp-dev/tunnel-broker/kcpplugin/coalesce"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
)

// WindowSize is the agent's HTTP/2 flow-control window per stream: fixed,
// like the broker's, so that ping-pong traffic sends no window PINGs.
const WindowSize = 1 << 20

// WriteBufferSize is gRPC's write buffer on the agent's connection: one
// flush of bulk data is 16 TLS records, sent with one syscall.
const WriteBufferSize = 256 << 10

// DefaultGrace is how long tunnels in flight may run once the agent drains.
const DefaultGrace = 20 * time.Second

// Agent serves one broker replica's address. A Fleet runs one per replica.
type Agent struct {
	// Broker is the replica's host:port.
	Broker string
	// Credentials are the agent's SPIFFE mTLS credentials.
	Credentials credentials.TransportCredentials
	// Name is shown in the broker's logs and listings.
	Name     string
	Resolver lookup.Resolver
	// Grace is how long tunnels in flight may run once Run's ctx ends.
	Grace time.Duration
	Log   *slog.Logger

	// Registered, if set, is called each time the broker accepts the agent.
	Registered func(brokerID string)

	registered atomic.Bool
	drainOnce  sync.Once
	draining   chan struct{}
	// admit orders a tunnel admission against the start of the drain, so
	// that no tunnel is added once Run waits for them.
	admit sync.Mutex
}

// IsRegistered reports whether the broker holds the agent's registration now.
func (a *Agent) IsRegistered() bool { return a.registered.Load() }

func (a *Agent) drainCh() chan struct{} {
	a.drainOnce.Do(func() { a.draining = make(chan struct{}) })
	return a.draining
}

// Run keeps the agent registered with the broker, reconnecting with
// exponential backoff and jitter, until ctx ends. Then it drains: it tells
// the broker to route it no new dials, refuses orders that still come, lets
// tunnels in flight run for Grace, and cancels what is left.
func (a *Agent) Run(ctx context.Context) error {
	conn, err := grpc.NewClient(a.Broker,
		// One write syscall per gRPC flush, not one per 16 KiB TLS record,
		// and flushes of up to 256 KiB, as the broker's (see its
		// WriteBufferSize).
		grpc.WithTransportCredentials(coalesce.Writes(a.Credentials)),
		grpc.WithWriteBufferSize(WriteBufferSize),
		// Ping every 5s, give up after 5s more: a broker that vanished
		// without a word is noticed in about ten seconds.
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: 5 * time.Second, Timeout: 5 * time.Second, PermitWithoutStream: true}),
		// Fixed windows, as the broker's (see its DefaultWindowSize).
		grpc.WithInitialWindowSize(WindowSize),
		grpc.WithInitialConnWindowSize(16*WindowSize),
	)
	if err != nil {
		return err
	}
	defer conn.Close()
	client := tunnelv1.NewAgentServiceClient(conn)
	draining := a.drainCh()

	// life outlives ctx by the grace period: sessions and tunnels use it.
	life, end := context.WithCancel(context.WithoutCancel(ctx))
	defer end()
	var tunnels sync.WaitGroup
	loopDone := make(chan struct{})
	go func() {
		defer close(loopDone)
		a.reconnect(life, client, &tunnels, draining)
	}()

	<-ctx.Done()
	a.admit.Lock()
	close(draining)
	a.admit.Unlock()
	grace := a.Grace
	if grace <= 0 {
		grace = DefaultGrace
	}
	finished := make(chan struct{})
	go func() { tunnels.Wait(); close(finished) }()
	select {
	case <-finished:
	case <-time.After(grace):
		a.Log.Info("grace period over, ending tunnels", "broker", a.Broker)
	}
	end()
	<-loopDone
	<-finished
	return nil
}

// reconnect runs sessions until life ends or the agent drains.
func (a *Agent) reconnect(life context.Context, client tunnelv1.AgentServiceClient, tunnels *sync.WaitGroup, draining <-chan struct{}) {
	backoff := newBackoff(250*time.Millisecond, 30*time.Second)
	for {
		registered, err := a.session(life, client, tunnels, draining)
		select {
		case <-draining:
			return
		case <-life.Done():
			return
		default:
		}
		if registered {
			backoff.reset()
		}
		wait := backoff.next()
		reconnects.Inc()
		a.Log.Info("broker connection lost, reconnecting", "broker", a.Broker, "error", err, "in", wait.Round(time.Millisecond))
		select {
		case <-time.After(wait):
		case <-draining:
			return
		case <-life.Done():
			return
		}
	}
}

// unregisterTimeout bounds how long an agent that stops waits for the broker
// to end its control stream after it closed its send direction.
const unregisterTimeout = time.Second

// session registers once and serves dial orders until the control stream
// ends. Once the agent drains it says so and refuses further orders, and the
// session ends when life does.
func (a *Agent) session(life context.Context, client tunnelv1.AgentServiceClient, tunnels *sync.WaitGroup, draining <-chan struct{}) (registered bool, err error) {
	// Once registered, the control stream outlives life by a moment: when
	// life ends the agent closes its send direction, the clean end of a
	// registration (the broker answers OK), and cancels only if the broker
	// does not answer in time. Until then, the end of life cancels at once.
	controlCtx, cancel := context.WithCancel(context.WithoutCancel(life))
	defer cancel()
	cancelEarly := context.AfterFunc(life, cancel)
	defer cancelEarly()
	control, err := client.Connect(controlCtx, grpc.WaitForReady(true))
	if err != nil {
		return false, err
	}
	for _, register := range registers(a.Resolver.Clusters(), a.Name) {
		if err := control.Send(register); err != nil {
			return false, err
		}
	}
	first, err := control.Recv()
	if err != nil {
		return false, err
	}
	reg := first.GetRegistered()
	if reg == nil {
		return false, errors.New("broker did not confirm the registration")
	}
	// Registered: from now on the end of life unregisters cleanly (below).
	cancelEarly()
	a.registered.Store(true)
	registeredBrokers.Inc()
	defer func() {
		a.registered.Store(false)
		registeredBrokers.Dec()
	}()
	a.Log.Info("registered with broker", "broker", a.Broker, "broker_id", reg.GetBrokerId(), "clusters", len(a.Resolver.Clusters()))
	if a.Registered != nil {
		a.Registered(reg.GetBrokerId())
	}

	var sendMu sync.Mutex // a gRPC stream takes one sender at a time
	send := func(m *tunnelv1.ConnectRequest) {
		sendMu.Lock()
		defer sendMu.Unlock()
		_ = control.Send(m)
	}
	fail := func(f *tunnelv1.DialFailure) {
		send(&tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_DialFailure{DialFailure: f}})
	}
	// Drain goes out once, before the send direction closes, however the
	// agent's stop and the announcer race.
	drain := sync.OnceFunc(func() {
		grace := a.Grace
		if grace <= 0 {
			grace = DefaultGrace
		}
		a.Log.Info("draining", "broker", a.Broker, "grace", grace)
		send(&tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Drain{Drain: &tunnelv1.Drain{GraceMs: uint32(grace.Milliseconds())}}})
	})
	go a.announce(controlCtx, send, draining, drain)
	sessionDone := make(chan struct{})
	defer close(sessionDone)
	unregister := context.AfterFunc(life, func() {
		if isClosed(draining) {
			drain()
		}
		sendMu.Lock()
		_ = control.CloseSend()
		sendMu.Unlock()
		select {
		case <-sessionDone:
		case <-time.After(unregisterTimeout):
			cancel()
		}
	})
	defer unregister()

	for {
		msg, err := control.Recv()
		if errors.Is(err, io.EOF) {
			return true, errors.New("broker closed the control stream")
		}
		if err != nil {
			return true, err
		}
		switch m := msg.GetMessage().(type) {
		case *tunnelv1.ConnectResponse_DialOrder:
			order := m.DialOrder
			a.admit.Lock()
			if isClosed(draining) {
				a.admit.Unlock()
				fail(&tunnelv1.DialFailure{DialId: order.GetDialId(), Code: int32(codes.Unavailable), Message: "the agent is shutting down"})
				continue
			}
			tunnels.Add(1)
			a.admit.Unlock()
			go func() {
				defer tunnels.Done()
				// Tunnels outlive a lost control stream (their data
				// streams are their own) but not the agent's life.
				a.serve(life, client, order, fail)
			}()
		case *tunnelv1.ConnectResponse_Probe:
			send(&tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Probe{Probe: m.Probe}})
		case *tunnelv1.ConnectResponse_Drain:
			a.Log.Info("broker is draining", "broker", a.Broker, "broker_grace", time.Duration(m.Drain.GetGraceMs())*time.Millisecond)
		default:
			return true, fmt.Errorf("unexpected message from broker: %T", m)
		}
	}
}

// announce re-registers when the resolver's clusters change, and tells the
// broker (drain) when the agent starts draining.
func (a *Agent) announce(ctx context.Context, send func(*tunnelv1.ConnectRequest), draining <-chan struct{}, drain func()) {
	var changed <-chan struct{}
	if w, ok := a.Resolver.(lookup.ClusterWatcher); ok {
		changed = w.ClustersChanged()
	}
	for {
		select {
		case <-changed:
			clusters := a.Resolver.Clusters()
			a.Log.Info("clusters changed, re-registering", "broker", a.Broker, "clusters", len(clusters))
			for _, register := range registers(clusters, a.Name) {
				send(register)
			}
		case <-draining:
			draining = nil
			drain()
		case <-ctx.Done():
			return
		}
	}
}

// ClustersPerRegister is how many clusters one Register message names: at
// most about 18 KiB of names, well within the broker's largest message
// (32 KiB by default). A longer list goes in several messages.
const ClustersPerRegister = 256

// registers are the Register messages that state clusters: all but the last
// set more, and the broker puts the set in force with the last.
func registers(clusters []string, name string) []*tunnelv1.ConnectRequest {
	var out []*tunnelv1.ConnectRequest
	for {
		n := min(len(clusters), ClustersPerRegister)
		out = append(out, &tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Register{Register: &tunnelv1.Register{
			Clusters: clusters[:n], AgentName: name, More: n < len(clusters),
		}}})
		if clusters = clusters[n:]; len(clusters) == 0 {
			return out
		}
	}
}

func isClosed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}
