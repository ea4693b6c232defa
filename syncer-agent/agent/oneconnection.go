package agent

import (
	"context"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/connectivity"
)

// errConnectionUsed refuses a second connection of an agent with
// OneConnection.
var errConnectionUsed = errors.New("behind one address, the agent keeps to its first connection to a broker replica")

// dialOnce dials until a connection has been ready, and then no more: a
// new connection through a load balancer may reach another replica, where
// a Tunnel stream would name a dial the replica never ordered.
type dialOnce struct {
	ready   atomic.Bool
	readyAt atomic.Pointer[time.Time]
	timer   sync.Once // the retirement's timer, started once
}

func (d *dialOnce) dial(ctx context.Context, addr string) (net.Conn, error) {
	if d.ready.Load() {
		return nil, errConnectionUsed
	}
	var dialer net.Dialer
	return dialer.DialContext(ctx, "tcp", addr)
}

// connectionGone is closed once the agent's connection, ready once, is not
// any more, with OneConnection (never without it, or before ctx ends).
func (a *Agent) connectionGone(ctx context.Context, conn *grpc.ClientConn) <-chan struct{} {
	gone := make(chan struct{})
	if a.dialOnce == nil {
		return gone
	}
	go func() {
		state := conn.GetState()
		for state != connectivity.Ready {
			if !conn.WaitForStateChange(ctx, state) {
				return
			}
			state = conn.GetState()
		}
		now := a.clock().Now()
		a.dialOnce.readyAt.Store(&now)
		a.dialOnce.ready.Store(true)
		if conn.WaitForStateChange(ctx, connectivity.Ready) {
			close(gone)
		}
	}()
	return gone
}

// retireAt is how far into a connection's age, which the broker's GOAWAY
// may cut a tenth short, the agent moves: early enough for the fleet to
// find the replica on a new connection first.
const retireAt = 0.8

// retireBefore calls Retiring once the connection, ready since the
// registration, nears age (zero: the broker asks for no new connection).
func (r *agentRun) retireBefore(age time.Duration) {
	d := r.dialOnce
	if d == nil || age <= 0 || r.Retiring == nil {
		return
	}
	readyAt := d.readyAt.Load()
	if readyAt == nil {
		// Registered on a connection not yet seen ready: counted from now.
		now := r.clock().Now()
		readyAt = &now
	}
	d.timer.Do(func() {
		timer := r.clock().NewTimer(readyAt.Add(time.Duration(float64(age) * retireAt)).Sub(r.clock().Now()))
		go func() {
			defer timer.Stop()
			select {
			case <-timer.C():
				r.Log.Info("connection to the broker nears its age: moving to a new one", "broker", r.Broker, "max_connection_age", age)
				r.Retiring()
			case <-r.ctx.Done():
			}
		}()
	})
}
