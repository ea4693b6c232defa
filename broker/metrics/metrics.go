// Package metrics holds the broker's own Prometheus metrics.
package metrics

import "github.com/prometheus/client_golang/prometheus"

// Registry holds every broker metric; the metrics endpoint serves it.
var Registry = prometheus.NewRegistry()

var (
	// Denied counts RPCs and registrations refused by policy.
	Denied = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "kcp_tunnel_broker",
		Name:      "denied_total",
		Help:      "Requests refused by the authorization policy, by gRPC method.",
	}, []string{"method"})
)

func init() {
	Registry.MustRegister(Denied)
}
