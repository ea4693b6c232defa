package dial

import (
	"context"
	"net"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/broker/internal/spares"
	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// Defaults of the dial connections' bounds (Config).
const (
	// DefaultMaxSparesPerPeer bounds the spare dial connections of one
	// SPIFFE ID: kcpplugin keeps 16 per Dialer, and one SPIFFE ID may be
	// shared by a few kcp shards.
	DefaultMaxSparesPerPeer = 64
	// DefaultMaxSpares bounds the spares of all peers together: each
	// costs a socket, a goroutine and its TLS state, about 20 KiB.
	DefaultMaxSpares = 1024
)

// ServeConn serves one dial connection (docs/protocol.md §3.6), already
// verified by the TLS handshake: it accepts it as a spare, naming the
// replica, waits for its caller's dial, dials as a Dial stream's first
// message does, and then carries the tunnel until it ends, and so on for
// one dial after another while the connection is left idle after each
// tunnel (§3.7). A refusal or a failed dial is the connection's last
// message.
func (s *Service) ServeConn(conn net.Conn, peer identity.AuthInfo) {
	for fresh := true; ; fresh = false {
		first, err := s.awaitDial(conn, peer.ID, fresh)
		if err != nil {
			s.endSpare(conn, peer.ID, err)
			return
		}
		if !s.serveDial(conn, peer, first) {
			return
		}
	}
}

// serveDial dials as first says and carries the tunnel on conn, and says
// whether the connection is idle after it; a refused or failed dial
// closes it.
func (s *Service) serveDial(conn net.Conn, peer identity.AuthInfo, first *tunnelv1.DialRequest) (idle bool) {
	caller := peer.ID
	if err := s.checkDial(first, caller, wire.DialProtocol); err != nil {
		refuseDial(conn, err)
		return false
	}
	release, err := s.holdTunnel(caller)
	if err != nil {
		refuseDial(conn, err)
		return false
	}
	defer release()
	// A tunnel has the grace of an RPC in flight when its peer's SVID
	// expires; a spare has none.
	end, err := peer.Begin()
	if err != nil {
		refuseDial(conn, err)
		return false
	}
	defer end()
	t, log, err := s.open(s.stopping(), first, caller)
	if err != nil {
		refuseDial(conn, err)
		return false
	}
	if err := wire.WriteDialResult(conn, t.ID, nil); err != nil {
		t.End(status.Error(codes.Canceled, "caller went away"))
		conn.Close()
		return false
	}
	leg := tunnel.NewConnLeg(conn, "dial_connection")
	metrics.TunnelsOpened.WithLabelValues("dial_connection").Inc()
	callerStatus, agentStatus := t.Splice(leg, s.cfg.Tunnels, s.spliced(release))
	s.ended(t, callerStatus, agentStatus, log)
	return leg.Finish(callerStatus)
}

// awaitDial takes conn as one of caller's spares, if the policy lets it
// dial (it may have changed since the connection's last tunnel) and the
// spares' bounds leave room, and waits for its dial (spares.Await).
func (s *Service) awaitDial(conn net.Conn, caller spiffeid.ID, fresh bool) (*tunnelv1.DialRequest, error) {
	if !s.cfg.Policy.IsCaller(caller) {
		metrics.Denied.WithLabelValues(wire.DialProtocol).Inc()
		s.cfg.Log.Warn("permission denied", "peer", caller.String(), "method", wire.DialProtocol)
		return nil, status.Errorf(codes.PermissionDenied, "%s may not open dial connections", caller)
	}
	return spares.Await(&s.spares, conn, caller, s.cfg.BrokerID, fresh, s.cfg.Draining, wire.ReadDial)
}

// endSpare ends a spare that has no dial (spares.End).
func (s *Service) endSpare(conn net.Conn, caller spiffeid.ID, err error) {
	if spares.End(conn, err) {
		s.cfg.Log.Info("dial connection ended before its dial", "peer", caller.String(), "error", err)
	}
}

// stopping bounds a dial connection's dial, besides the dial timeout. The
// connection is not read while its dial waits (what follows the dial is
// the tunnel's), so a caller that goes away is noticed only at the answer;
// the broker's stop ends the dial at once.
func (s *Service) stopping() context.Context {
	if s.cfg.Tunnels.Stopping == nil {
		return context.Background()
	}
	return s.cfg.Tunnels.Stopping
}

// refuseDial answers a dial with err, its failure, and closes the
// connection once what the caller sent behind its dial is read
// (wire.CloseRefused), so that the caller reads why and not a reset. A
// spare refused before its dial, whose caller sends nothing, or whose dial
// did not decode, is closed at once (spares.Refuse).
func refuseDial(conn net.Conn, err error) {
	_ = wire.WriteDialResult(conn, "", err)
	wire.CloseRefused(conn)
}
