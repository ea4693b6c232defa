package admission

import (
	"context"
	"log/slog"
	"time"

	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
)

// Every tunnel, once it has ended, leaves one audit line at INFO, whatever
// the log level asks of other lines: who (the caller's SPIFFE ID, or "unix socket", and its front end), what
// (the target), through which agent and replica, when, how long, how many
// bytes each way, and how it ended (the caller's status code). Its fields
// sit in the "audit" group, under names that do not change
// (docs/operations.md, "Audit log"), so that they can be shipped to a log pipeline
// and queried there.

// AuditMessage is the message of every audit line.
const AuditMessage = "tunnel audit"

// audit logs t's audit line; frontend is the one the caller came through,
// and callerStatus how the caller's leg ended.
func (a *Admission) audit(t *tunnel.Tunnel, frontend string, callerStatus error) {
	up, down := t.Bytes()
	target := t.Target
	a.cfg.Log.LogAttrs(context.Background(), slog.LevelInfo, AuditMessage, slog.Group("audit",
		slog.String("tunnel", t.ID),
		slog.String("caller", t.Caller),
		slog.String("frontend", frontend),
		slog.String("cluster", target.GetCluster()),
		slog.String("namespace", target.GetNamespace()),
		slog.String("service", target.GetService()),
		slog.String("ip", target.GetIp()),
		slog.Uint64("port", uint64(target.GetPort())),
		slog.String("agent", t.Agent.Name),
		slog.String("agent_id", t.Agent.ID.String()),
		slog.String("broker", a.cfg.BrokerID),
		slog.Time("start", t.Established.UTC()),
		slog.Float64("duration_s", time.Since(t.Established).Seconds()),
		slog.Int64("bytes_up", up),
		slog.Int64("bytes_down", down),
		slog.String("code", status.Code(callerStatus).String()),
		slog.String("trace_id", t.TraceID),
	))
}
