package agent

import (
	"context"
	"errors"
	"io"
	"net"

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
		refuse(conn, status.Errorf(codes.PermissionDenied, "%s may not open data connections", id))
		return
	}
	release, err := s.spares.Take(id)
	if err != nil {
		refuse(conn, err)
		return
	}
	// The replica's name tells an agent behind a load balancer that this
	// spare reached another replica than its control stream.
	if err := wire.WriteAccepted(conn, s.cfg.BrokerID); err != nil {
		release()
		conn.Close()
		return
	}
	dialID, err := s.awaitOpen(conn)
	release()
	if err != nil {
		if st, ok := status.FromError(err); ok {
			refuse(conn, st.Err())
		} else {
			conn.Close()
		}
		if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
			s.cfg.Log.Info("data connection ended before its open", "peer", id.String(), "error", err)
		}
		return
	}
	// A tunnel has the grace of an RPC in flight when its peer's SVID
	// expires; a spare has none.
	end, err := peer.Begin()
	if err != nil {
		refuse(conn, err)
		return
	}
	defer end()
	if err := tunnel.OpenConn(s.cfg.Registry, dialID, id, conn); status.Code(err) == codes.NotFound {
		s.cfg.Log.Info("data connection opened for a dial that is not pending", "peer", id.String(), "dial", dialID, "error", err)
	}
}

// awaitOpen waits for the open of a spare. A spare waits as long as its
// agent likes: what bounds spares is their number (Config.MaxSpares...).
// The broker's drain closes them, since no dial will be ordered any more.
func (s *Service) awaitOpen(conn net.Conn) (uint64, error) {
	stop := context.AfterFunc(s.cfg.Draining, func() { conn.Close() })
	dialID, err := wire.ReadOpen(conn)
	if !stop() {
		return 0, status.Error(codes.Unavailable, "the broker is shutting down")
	}
	return dialID, err
}

// refuse answers a data connection with err and closes it.
func refuse(conn net.Conn, err error) {
	_ = wire.WriteOpenResult(conn, err)
	conn.Close()
}
