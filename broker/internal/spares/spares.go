// Package spares bounds the connections the broker holds open for its peers
// before they carry a tunnel: the agents' spare data connections and the
// callers' spare dial connections (docs/protocol.md §3.5, §3.6). A spare
// costs a socket, its TLS state and a goroutine while it waits, as long as
// its peer likes, so what bounds them is their number.
package spares

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/broker/internal/quota"
	"github.com/kcp-dev/tunnel-broker/broker/metrics"
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
