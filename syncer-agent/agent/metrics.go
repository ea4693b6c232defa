package agent

import "github.com/prometheus/client_golang/prometheus"

const ns = "kcp_tunnel_agent"

// Metrics of the agent; register them with Register.
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
)

// RegisterMetrics adds the agent's metrics to r.
func RegisterMetrics(r prometheus.Registerer) {
	r.MustRegister(reconnects, registeredBrokers, dials, tunnelsOpen)
}
