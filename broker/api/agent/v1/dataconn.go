package agent

import (
	"net"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

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
// dial's tunnel until the tunnel ends, and so on for one tunnel after
// another while the connection is left idle after each (§3.7). A refusal
// is the connection's last message.
func (s *Service) ServeData(conn net.Conn, peer identity.AuthInfo) {
	for fresh := true; ; fresh = false {
		dialID, ok := s.awaitOpen(conn, peer.ID, fresh)
		if !ok || !s.carry(conn, peer, dialID) {
			return
		}
	}
}

// awaitOpen holds conn as a spare of the agent id, if the policy lets it
// register (it may have changed since the last tunnel), until the agent
// names a dial; false if the connection ended meanwhile.
func (s *Service) awaitOpen(conn net.Conn, id spiffeid.ID, fresh bool) (dialID uint64, ok bool) {
	if !s.cfg.Policy.IsAgent(id) {
		metrics.Denied.WithLabelValues(wire.DataProtocol).Inc()
		s.cfg.Log.Warn("permission denied", "peer", id.String(), "method", wire.DataProtocol)
		spares.Refuse(conn, status.Errorf(codes.PermissionDenied, "%s may not open data connections", id))
		return 0, false
	}
	dialID, err := spares.Await(&s.spares, conn, id, s.cfg.BrokerID, fresh, s.cfg.Draining, wire.ReadOpen)
	if err != nil {
		if spares.End(conn, err) {
			s.cfg.Log.Info("data connection ended before its open", "peer", id.String(), "error", err)
		}
		return 0, false
	}
	return dialID, true
}

// carry carries the tunnel of dial dialID on conn, and says whether the
// connection is idle after it.
func (s *Service) carry(conn net.Conn, peer identity.AuthInfo, dialID uint64) (idle bool) {
	// A tunnel has the grace of an RPC in flight when its peer's SVID
	// expires; a spare has none.
	end, err := peer.Begin()
	if err != nil {
		spares.Refuse(conn, err)
		return false
	}
	defer end()
	leg := tunnel.NewConnLeg(conn, "data_connection")
	err = tunnel.OpenConn(s.cfg.Registry, dialID, peer.ID, leg)
	if status.Code(err) == codes.NotFound {
		s.cfg.Log.Info("data connection opened for a dial that is not pending", "peer", peer.ID.String(), "dial", dialID, "error", err)
	}
	return leg.Finish(err)
}
