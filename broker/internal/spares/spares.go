// Package spares bounds the connections the broker holds open for its peers
// before they carry a tunnel: the agents' spare data connections and the
// callers' spare dial connections (docs/protocol.md §3.5, §3.6). A spare
// costs a socket, its TLS state and a goroutine while it waits, as long as
// its peer likes, so what bounds them is their number.
package spares

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/broker/internal/quota"
	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// Bound is one kind of spares' bounds: Quota's PerID for one SPIFFE ID and
// Total for all, counted in Gauge while held. Kind ("data", "dial") names
// the limits, spare_<kind>_connections_per_peer and
// spare_<kind>_connections, in kcp_tunnel_broker_limits_hit_total.
type Bound struct {
	quota.Quota
	Kind  string
	Gauge prometheus.Gauge
}

// Take counts one more spare of id, unless a bound is reached: then it
// counts the limit hit and returns a ResourceExhausted status, which the
// connection's answer carries. release may be called more than once.
func (b *Bound) Take(id spiffeid.ID) (release func(), err error) {
	releaseQuota, over := b.Quota.Take(id)
	if over != quota.Under {
		limit := "spare_" + b.Kind + "_connections"
		if over == quota.OverPerID {
			limit += "_per_peer"
		}
		metrics.LimitsHit.WithLabelValues(limit).Inc()
		return nil, status.Errorf(codes.ResourceExhausted, "too many spare %s connections (%s)", b.Kind, limit)
	}
	b.Gauge.Inc()
	return sync.OnceFunc(func() {
		releaseQuota()
		b.Gauge.Dec()
	}), nil
}

// ErrDrained ends a spare that the broker's drain has answered and closed.
var ErrDrained = errors.New("answered at the drain")

// Await holds conn as one of id's spares within b's bounds while it waits
// for the peer's first message: it answers a new connection's acceptance,
// naming the replica brokerID (a connection idle again after a tunnel,
// docs/protocol.md §3.7, hears none), reads the message with read, and
// stops counting the spare once read returns. A spare waits as long as its
// peer likes: what bounds spares is their number. The drain (draining
// ending) refuses new spares with Unavailable, and ends the wait of the
// others: it answers them Unavailable and closes them (ErrDrained). A
// close, unlike a read deadline, is not undone by gRPC clearing its
// handshake deadline on the socket just after the connection was handed
// over.
func Await[T any](b *Bound, conn net.Conn, id spiffeid.ID, brokerID string, fresh bool, draining context.Context, read func(io.Reader) (T, error)) (T, error) {
	var none T
	release, err := b.Admit(id, draining)
	if err != nil {
		return none, err
	}
	defer release()
	if fresh {
		if err := wire.WriteAccepted(conn, brokerID); err != nil {
			return none, err
		}
	}
	return Read(conn, draining, read)
}

// Admit counts one more spare of id, unless the broker drains (draining
// has ended: Unavailable) or a bound is reached (Take).
func (b *Bound) Admit(id spiffeid.ID, draining context.Context) (release func(), err error) {
	if draining.Err() != nil {
		return nil, errShuttingDown
	}
	return b.Take(id)
}

// Read reads a spare's next message from its peer with read, as slowly as
// the peer likes, until the drain (draining ending) answers the spare
// Unavailable and closes it, which ends the read with ErrDrained.
func Read[T any](conn net.Conn, draining context.Context, read func(io.Reader) (T, error)) (T, error) {
	var none T
	answered := make(chan struct{})
	stop := context.AfterFunc(draining, func() {
		defer close(answered)
		Refuse(conn, errShuttingDown)
	})
	first, err := read(conn)
	if !stop() {
		<-answered
		return none, ErrDrained
	}
	return first, err
}

var errShuttingDown = status.Error(codes.Unavailable, "the broker is shutting down")

// End ends a spare whose wait (Await) failed with err: it answers a status
// with it, and closes a connection that failed or ended. The peer going
// away and the drain are not worth a log line; anything else is (worthy).
func End(conn net.Conn, err error) (worthy bool) {
	if _, ok := status.FromError(err); ok {
		Refuse(conn, err)
		return false
	}
	conn.Close()
	return !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) && !errors.Is(err, ErrDrained)
}

// Refuse answers a spare, or a tunnel's first message on it, with err's
// status (an OpenResult, as data and dial connections answer alike), and
// closes it with a close_notify.
func Refuse(conn net.Conn, err error) {
	_ = wire.WriteOpenResult(conn, err)
	conn.Close()
}
