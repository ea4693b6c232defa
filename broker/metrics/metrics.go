// Package metrics holds the broker's own Prometheus metrics. The gRPC
// server's RPC metrics come from go-grpc-middleware's provider (GRPC).
package metrics

import (
	grpcprom "github.com/grpc-ecosystem/go-grpc-middleware/providers/prometheus"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kcp-dev/tunnel-broker/internal/identity"
)

// Registry holds every broker metric; the metrics endpoint serves it.
var Registry = prometheus.NewRegistry()

const ns = "kcp_tunnel_broker"

var (
	// GRPC counts and times every RPC, by method and code.
	GRPC = grpcprom.NewServerMetrics(grpcprom.WithServerHandlingTimeHistogram())

	// Denied counts requests refused by policy (authz.Deny).
	Denied = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: ns, Name: "denied_total",
		Help: "Requests refused by the authorization policy, by what was asked: call (an RPC), serve, dial, egress.",
	}, []string{"asked"})

	// Dials counts dials by the status the caller got.
	Dials = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: ns, Name: "dials_total",
		Help: "Dials by resulting gRPC status code.",
	}, []string{"code"})

	// DialSeconds is the time from a dial's target to its established tunnel
	// (or its failure).
	DialSeconds = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: ns, Name: "dial_duration_seconds",
		Help:    "Time to establish a tunnel, or to fail, by resulting gRPC status code.",
		Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10},
	}, []string{"code"})

	// Tunnels is the number of tunnels being spliced.
	Tunnels = prometheus.NewGauge(prometheus.GaugeOpts{
		Namespace: ns, Name: "tunnels",
		Help: "Tunnels open through this replica.",
	})

	// TunnelsOpened counts the tunnels spliced, by the caller's leg: a
	// Dial stream or the CONNECT front end.
	TunnelsOpened = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: ns, Name: "tunnels_opened_total",
		Help: "Tunnels spliced by this replica, by the caller's leg (stream, connect).",
	}, []string{"caller_leg"})

	// Bytes counts tunneled bytes; up is caller to target.
	Bytes = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: ns, Name: "tunnel_bytes_total",
		Help: "Bytes carried by tunnels, by direction (up: caller to target, down: target to caller).",
	}, []string{"direction"})
	BytesUp   = Bytes.WithLabelValues("up")
	BytesDown = Bytes.WithLabelValues("down")

	// LimitsHit counts requests refused by a limit.
	LimitsHit = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: ns, Name: "limits_hit_total",
		Help: "Requests refused or tunnels ended by a limit, by limit.",
	}, []string{"limit"})

	// Registrations counts agent registrations (a reconnect is one more).
	Registrations = prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: ns, Name: "agent_registrations_total",
		Help: "Agent registrations accepted; reconnects add to it.",
	})

	// ProbeRTT is the round trip of each agent's last answered probe.
	ProbeRTT = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: ns, Name: "agent_probe_rtt_seconds",
		Help: "Round trip of the last probe the agent answered.",
	}, []string{"agent", "spiffe_id"})

	// ProbeSuccess is when each agent last answered a probe.
	ProbeSuccess = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: ns, Name: "agent_probe_last_success_timestamp_seconds",
		Help: "When the agent last answered a probe (Unix time).",
	}, []string{"agent", "spiffe_id"})

	// Reachable is 1 while an agent answers its probes, 0 once it missed
	// one or went away.
	Reachable = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: ns, Name: "agent_reachable",
		Help: "1 while the agent answers probes on this replica, 0 after it missed one or disconnected.",
	}, []string{"agent", "spiffe_id"})

	// HandshakesRefused counts TLS handshakes that failed, by reason.
	HandshakesRefused = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: ns, Name: "handshakes_refused_total",
		Help: "TLS handshakes refused or failed, by reason (untrusted, expired, invalid_id, timeout, over_limit, ...).",
	}, []string{"reason"})

	// ConnectionsClosed counts connections the broker closed for what
	// their peer sent, by reason.
	ConnectionsClosed = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: ns, Name: "connections_closed_total",
		Help: "Connections closed for what their peer sent, by reason (fragmented_data: HTTP/2 DATA frames too small to hold a whole gRPC message, or padded).",
	}, []string{"reason"})
	// ClosedFragmented counts connections whose peer sent data in
	// fragments (package fragments).
	ClosedFragmented = ConnectionsClosed.WithLabelValues("fragmented_data")

	// EgressRequests counts the CONNECT front end's requests by front end
	// (uds, tls) and the HTTP status they got.
	EgressRequests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: ns, Name: "egress_requests_total",
		Help: "Requests to the CONNECT front end, by front end (uds, tls) and HTTP status answered (0: the connection ended before an answer).",
	}, []string{"frontend", "code"})

	// EgressTunnels is the number of tunnels the CONNECT front end splices,
	// by front end; they count in tunnels too.
	EgressTunnels = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: ns, Name: "egress_tunnels",
		Help: "Tunnels open through the CONNECT front end, by front end (uds, tls).",
	}, []string{"frontend"})
)

// CountRefusedHandshake counts one failed TLS handshake.
func CountRefusedHandshake(reason identity.Reason) {
	HandshakesRefused.WithLabelValues(string(reason)).Inc()
}

func init() {
	Registry.MustRegister(GRPC, Denied, Dials, DialSeconds, Tunnels, Bytes, LimitsHit,
		Registrations, ProbeRTT, ProbeSuccess, Reachable, HandshakesRefused, ConnectionsClosed,
		EgressRequests, EgressTunnels, TunnelsOpened)
	for _, r := range identity.Reasons {
		HandshakesRefused.WithLabelValues(string(r))
	}
}
