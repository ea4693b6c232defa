package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
)

// shuttingDown is why a draining agent refuses the orders that still
// come.
const shuttingDown = "the agent is shutting down"

// unregisterTimeout bounds how long an agent that stops waits for the broker
// to end its control stream after it closed its send direction.
const unregisterTimeout = time.Second

// session registers once and serves dial orders until the control stream
// ends; it reports whether the broker confirmed the registration. Once the
// agent drains, the session says so and refuses further orders, and it
// ends the registration when the run ends.
func (r *agentRun) session() (registered bool, err error) {
	// The control stream has a context of its own. Until the broker
	// confirms the registration, the end of the run cancels it at once;
	// after that, the end of the run unregisters cleanly (unregister).
	ctx, cancel := context.WithCancel(context.WithoutCancel(r.ctx))
	defer cancel()
	cancelUnlessRegistered := context.AfterFunc(r.ctx, cancel)
	defer cancelUnlessRegistered()
	stream, err := r.connect(ctx, cancel)
	if err != nil {
		return false, err
	}
	confirmed, err := r.register(stream)
	if err != nil {
		return false, err
	}
	cancelUnlessRegistered()
	r.retireBefore(confirmed.GetMaxConnectionAge().AsDuration())
	defer r.markRegistered(confirmed.GetBrokerId())()
	control := r.newControlStream(stream)
	go r.announce(ctx, control)
	sessionOver := make(chan struct{})
	defer close(sessionOver)
	stopUnregister := context.AfterFunc(r.ctx, func() { r.unregister(control, cancel, sessionOver) })
	defer stopUnregister()
	return true, r.serveOrders(control)
}

// reportUnreachableEvery is how often an agent that cannot reach its broker
// says so, with the last connection error.
const reportUnreachableEvery = 5 * time.Second

// unreachableError is an attempt to open the control stream that found no
// connection to the broker in reportUnreachableEvery; err is gRPC's, with
// the last connection error.
type unreachableError struct {
	err    error
	waited time.Duration
}

func (e *unreachableError) Error() string { return e.err.Error() }

// connect opens the control stream on ctx, which cancel ends. It waits for
// a connection to the broker: gRPC keeps trying to connect meanwhile, with
// its backoff (Agent.dial), so the stream opens as soon as the broker
// answers. A fail-fast call would instead fail at once while gRPC waits
// out its backoff, and a wait of the agent's own after that failure would
// add up with gRPC's. After reportUnreachableEvery without a connection it
// gives up, so that reconnect says why, and tries again at once.
func (r *agentRun) connect(ctx context.Context, cancel context.CancelFunc) (tunnelv1.AgentService_ConnectClient, error) {
	giveUp := time.AfterFunc(reportUnreachableEvery, cancel)
	stream, err := r.client.Connect(ctx, grpc.WaitForReady(true))
	if !giveUp.Stop() && r.ctx.Err() == nil {
		if err == nil {
			// Opened as the wait ran out: cancelled already.
			err = context.Canceled
		}
		return nil, &unreachableError{err: err, waited: reportUnreachableEvery}
	}
	return stream, err
}

// register states the agent's clusters and waits for the broker to confirm
// them.
func (r *agentRun) register(stream tunnelv1.AgentService_ConnectClient) (*tunnelv1.Registered, error) {
	clusters := r.Resolver.Clusters()
	for _, m := range registers(clusters, r.Name) {
		if err := stream.Send(m); err != nil {
			return nil, err
		}
	}
	first, err := stream.Recv()
	if err != nil {
		return nil, err
	}
	confirmed := first.GetRegistered()
	if confirmed == nil {
		return nil, errors.New("broker did not confirm the registration")
	}
	r.Log.Info("registered with broker", "broker", r.Broker, "broker_id", confirmed.GetBrokerId(), "clusters", len(clusters))
	return confirmed, nil
}

// markRegistered marks the agent registered, and tells Registered; the
// function it returns marks the registration's end.
func (a *Agent) markRegistered(brokerID string) (unmark func()) {
	a.registered.Store(true)
	registeredBrokers.Inc()
	if a.Registered != nil {
		a.Registered(brokerID)
	}
	return func() {
		a.registered.Store(false)
		registeredBrokers.Dec()
	}
}

// serveOrders answers the broker's messages until the control stream ends:
// a tunnel for each dial order, on a Tunnel stream, and an echo for each
// probe.
func (r *agentRun) serveOrders(control *controlStream) error {
	for {
		msg, err := control.stream.Recv()
		if errors.Is(err, io.EOF) {
			return errors.New("broker closed the control stream")
		}
		if err != nil {
			return err
		}
		switch m := msg.GetMessage().(type) {
		case *tunnelv1.ConnectResponse_DialOrder:
			r.startTunnel(m.DialOrder, control)
		case *tunnelv1.ConnectResponse_Probe:
			control.send(&tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Probe{Probe: m.Probe}})
		case *tunnelv1.ConnectResponse_Drain:
			// Behind one address, the connection stays the replica's until
			// the replica goes: the brokers count a replica from its start
			// until it is gone (--replicas-dns), so there is none to look
			// for in its place, and the one that replaces it was counted,
			// and reached, from its own start.
			r.Log.Info("broker is draining", "broker", r.Broker, "broker_grace", time.Duration(m.Drain.GetGraceMs())*time.Millisecond)
		case *tunnelv1.ConnectResponse_Replicas:
			if r.Replicas != nil {
				r.Replicas(int(m.Replicas.GetCount()))
			}
		default:
			return fmt.Errorf("unexpected message from broker: %T", m)
		}
	}
}

// startTunnel serves order in goroutines of its own, or refuses it once
// the agent drains.
func (r *agentRun) startTunnel(order *tunnelv1.DialOrder, control *controlStream) {
	if !r.admit() {
		control.fail(&tunnelv1.DialFailure{DialId: order.GetDialId(), Code: int32(codes.Unavailable), Message: shuttingDown})
		return
	}
	go func() {
		// Tunnels outlive a lost control stream (their data streams are
		// their own) but not the run.
		run := r.open(r.ctx, r.client, order, control.fail)
		if run == nil {
			r.tunnels.Done()
			return
		}
		// The tunnel's life gets a goroutine of its own. Setting it up
		// (resolving, connecting, opening its Tunnel stream) grows this one's
		// stack to 8 KiB, which it would keep while it waits on an idle
		// tunnel; a new goroutine starts small (docs/perf-history.md, idle
		// tunnels' stacks).
		go func() {
			defer r.tunnels.Done()
			run()
		}()
	}()
}

// announce re-registers when the resolver's clusters change, and tells the
// broker (drain) when the agent starts draining, until ctx ends.
func (r *agentRun) announce(ctx context.Context, control *controlStream) {
	var changed <-chan struct{}
	if w, ok := r.Resolver.(lookup.ClusterWatcher); ok {
		changed = w.ClustersChanged()
	}
	draining := r.draining
	for {
		select {
		case <-changed:
			clusters := r.Resolver.Clusters()
			r.Log.Info("clusters changed, re-registering", "broker", r.Broker, "clusters", len(clusters))
			for _, register := range registers(clusters, r.Name) {
				control.send(register)
			}
		case <-draining:
			draining = nil
			control.drain()
		case <-ctx.Done():
			return
		}
	}
}

// unregister ends the registration the clean way when the run ends: after
// the drain, it closes its send direction, to which the broker answers by
// ending the stream with OK; if the broker has not done so within
// unregisterTimeout, it cancels the stream.
func (r *agentRun) unregister(control *controlStream, cancel context.CancelFunc, sessionOver <-chan struct{}) {
	// The run ends after the drain began; the announcer may not have
	// sent it yet.
	control.drain()
	control.closeSend()
	timer := r.clock().NewTimer(unregisterTimeout)
	defer timer.Stop()
	select {
	case <-sessionOver:
	case <-timer.C():
		cancel()
	}
}
