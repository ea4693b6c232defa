package agent

import (
	"net"

	"github.com/kcp-dev/tunnel-broker/broker/internal/spares"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// Defaults of the data connections' bounds (Config).
const (
	// DefaultMaxSparesPerPeer bounds the spare data connections of one
	// SPIFFE ID: an agent keeps two per replica, and one SPIFFE ID may
	// run a few agents side by side.
	DefaultMaxSparesPerPeer = 16
	// DefaultMaxSpares bounds the spares of all peers together: each
	// costs a socket, a goroutine and its TLS state, about 20 KiB.
	DefaultMaxSpares = 1024
)

// ServeData serves one data connection (docs/protocol.md §3.5), already
// verified by the TLS handshake: it accepts it as a spare, naming the
// replica, and waits for its agent to name a dial, then carries that
// dial's tunnel until the tunnel ends. It closes the connection. A
// refusal is the connection's last message.
func (s *Service) ServeData(conn net.Conn, peer identity.AuthInfo) {
	id := peer.ID
	if !s.cfg.Policy.IsAgent(id) {
		metrics.Denied.WithLabelValues(wire.DataProtocol).Inc()
		s.cfg.Log.Warn("permission denied", "peer", id.String(), "method", wire.DataProtocol)
		spares.Refuse(conn, status.Errorf(codes.PermissionDenied, "%s may not open data connections", id))
		return
	}
	dialID, err := spares.Await(&s.spares, conn, id, s.cfg.BrokerID, s.cfg.Draining, wire.ReadOpen)
	if err != nil {
		if spares.End(conn, err) {
			s.cfg.Log.Info("data connection ended before its open", "peer", id.String(), "error", err)
		}
		return
	}
	// A tunnel has the grace of an RPC in flight when its peer's SVID
	// expires; a spare has none.
	end, err := peer.Begin()
	if err != nil {
		spares.Refuse(conn, err)
		return
	}
	defer end()
	if err := tunnel.OpenConn(s.cfg.Registry, dialID, id, conn); status.Code(err) == codes.NotFound {
		s.cfg.Log.Info("data connection opened for a dial that is not pending", "peer", id.String(), "dial", dialID, "error", err)
	}
}
