// Package agent is the syncer agent's side of the tunnel: it keeps a control
// stream to the broker, and for each dial order connects to the target its
// Resolver names and pipes bytes over a Tunnel stream of its own.
package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
)

// Agent serves one broker address.
type Agent struct {
	// Broker is the broker's host:port.
	Broker string
	// Credentials are the agent's SPIFFE mTLS credentials.
	Credentials credentials.TransportCredentials
	// Name is shown in the broker's logs and listings.
	Name     string
	Resolver lookup.Resolver
	Log      *slog.Logger

	// Registered, if set, is called each time the broker accepts the agent.
	Registered func(brokerID string)
}

// Run keeps the agent registered with the broker until ctx ends, reconnecting
// with exponential backoff and jitter. Tunnels in flight when ctx ends are
// cancelled; Run returns after they are gone.
func (a *Agent) Run(ctx context.Context) error {
	conn, err := grpc.NewClient(a.Broker,
		grpc.WithTransportCredentials(a.Credentials),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: 10 * time.Second, Timeout: 5 * time.Second, PermitWithoutStream: true}),
	)
	if err != nil {
		return err
	}
	defer conn.Close()
	client := tunnelv1.NewAgentServiceClient(conn)

	var tunnels sync.WaitGroup
	defer tunnels.Wait()
	backoff := newBackoff(250*time.Millisecond, 30*time.Second)
	for {
		registered, err := a.session(ctx, client, &tunnels)
		if ctx.Err() != nil {
			return nil
		}
		if registered {
			backoff.reset()
		}
		wait := backoff.next()
		a.Log.Info("broker connection lost, reconnecting", "broker", a.Broker, "error", err, "in", wait.Round(time.Millisecond))
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return nil
		}
	}
}

// session registers once and serves dial orders until the control stream ends.
func (a *Agent) session(ctx context.Context, client tunnelv1.AgentServiceClient, tunnels *sync.WaitGroup) (registered bool, err error) {
	controlCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	control, err := client.Connect(controlCtx, grpc.WaitForReady(true))
	if err != nil {
		return false, err
	}
	register := &tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Register{Register: &tunnelv1.Register{
		Clusters:  a.Resolver.Clusters(),
		AgentName: a.Name,
	}}}
	if err := control.Send(register); err != nil {
		return false, err
	}
	first, err := control.Recv()
	if err != nil {
		return false, err
	}
	reg := first.GetRegistered()
	if reg == nil {
		return false, errors.New("broker did not confirm the registration")
	}
	a.Log.Info("registered with broker", "broker", a.Broker, "broker_id", reg.GetBrokerId(), "clusters", a.Resolver.Clusters())
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
	if w, ok := a.Resolver.(lookup.ClusterWatcher); ok {
		go func() {
			for {
				select {
				case <-w.ClustersChanged():
					clusters := a.Resolver.Clusters()
					a.Log.Info("clusters changed, re-registering", "broker", a.Broker, "clusters", clusters)
					send(&tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Register{Register: &tunnelv1.Register{
						Clusters: clusters, AgentName: a.Name,
					}}})
				case <-controlCtx.Done():
					return
				}
			}
		}()
	}
	for {
		msg, err := control.Recv()
		if errors.Is(err, io.EOF) {
			return true, errors.New("broker closed the control stream")
		}
		if err != nil {
			return true, err
		}
		order := msg.GetDialOrder()
		if order == nil {
			return true, fmt.Errorf("unexpected message from broker: %T", msg.GetMessage())
		}
		tunnels.Add(1)
		go func() {
			defer tunnels.Done()
			// Tunnels outlive a lost control stream (their data streams are
			// their own) but not the agent.
			a.serve(ctx, client, order, fail)
		}()
	}
}

// backoff is exponential with jitter (each wait drawn from [d/2, d]), so
// agents that lost the same broker do not come back in lockstep.
type backoff struct {
	min, max, cur time.Duration
}

func newBackoff(min, max time.Duration) *backoff { return &backoff{min: min, max: max, cur: min} }

func (b *backoff) next() time.Duration {
	d := b.cur/2 + rand.N(b.cur/2+1)
	b.cur = min(b.cur*2, b.max)
	return d
}

func (b *backoff) reset() { b.cur = b.min }
