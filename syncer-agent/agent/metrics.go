package agent

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kcp-dev/tunnel-broker/internal/identity"
)

const ns = "kcp_tunnel_agent"

// Metrics of the agent; RegisterMetrics adds them to a registry.
var (
	reconnects = prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: ns, Name: "broker_reconnects_total",
		Help: "Times a control stream to a broker replica was lost and dialled again.",
	})
	registeredBrokers = prometheus.NewGauge(prometheus.GaugeOpts{
		Namespace: ns, Name: "registered_brokers",
		Help: "Broker replicas that hold this agent's registration now.",
	})
	dials = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: ns, Name: "dials_total",
		Help: "Dial orders served, by resulting gRPC status code.",
	}, []string{"code"})
	tunnelsOpen = prometheus.NewGauge(prometheus.GaugeOpts{
		Namespace: ns, Name: "tunnels",
		Help: "Tunnels open through this agent.",
	})
	tunnelsOpened = prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: ns, Name: "tunnels_opened_total",
		Help: "Tunnels opened to the broker: a Tunnel stream's open sent.",
	})
	handshakesRefused = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: ns, Name: "handshakes_refused_total",
		Help: "TLS handshakes with broker replicas that failed, by reason (invalid_id, untrusted, unauthorized, timeout, ...).",
	}, []string{"reason"})
)

// CountRefusedHandshake counts one failed TLS handshake with a broker.
func CountRefusedHandshake(reason identity.Reason) {
	handshakesRefused.WithLabelValues(string(reason)).Inc()
}

// RegisterMetrics adds the agent's metrics to r.
func RegisterMetrics(r prometheus.Registerer) {
	r.MustRegister(reconnects, registeredBrokers, dials, tunnelsOpen, tunnelsOpened, handshakesRefused)
	for _, reason := range identity.Reasons {
		handshakesRefused.WithLabelValues(string(reason))
	}
}
