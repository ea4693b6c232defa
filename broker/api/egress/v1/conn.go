package egress

import (
	"bufio"
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/broker/internal/quota"
	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// refusal is a CONNECT answered without a tunnel.
type refusal struct {
	code   int
	reason string
	header []string
}

func (r *refusal) Error() string { return r.reason }

func refuse(code int, reason string, header ...string) *refusal {
	return &refusal{code: code, reason: reason, header: header}
}

// serveConn serves one connection: its request, its dial, its answer and,
// after a 200, its tunnel.
func (s *Server) serveConn(raw net.Conn) {
	defer raw.Close()
	deadline := time.Now().Add(s.cfg.Timeout)
	_ = raw.SetDeadline(deadline)
	conn, who, err := s.handshake(raw)
	if err != nil {
		s.releaseOpening()
		s.count(0)
		s.cfg.Log.Info("egress handshake failed", "remote", raw.RemoteAddr().String(), "error", err)
		return
	}
	t, br, release, err := s.open(conn, who, deadline)
	s.releaseOpening()
	if r, ok := errors.AsType[*refusal](err); ok {
		s.count(r.code)
		_ = reply(conn, r.code, r.reason, r.header...)
		return
	}
	if _, err := conn.Write([]byte(established)); err != nil {
		release()
		s.count(0)
		t.End(status.Error(codes.Canceled, "the CONNECT client went away before its answer"))
		return
	}
	s.count(http.StatusOK)
	_ = conn.SetDeadline(time.Time{})
	s.splice(&bufferedConn{Conn: conn, r: br}, t, release, s.cfg.Log.With("caller", who.String(), "tunnel", t.ID, "agent", t.Agent.String()))
}

// open reads the CONNECT and dials its target: the tunnel, what the client
// sent after its request, and the release of its quota; or a refusal.
func (s *Server) open(conn net.Conn, who caller, deadline time.Time) (*tunnel.Tunnel, *bufio.Reader, func(), error) {
	req, br, err := readRequest(conn, s.cfg.MaxHeaderBytes)
	if err != nil {
		return nil, nil, nil, refuse(http.StatusBadRequest, err.Error())
	}
	if req.Method != http.MethodConnect {
		return nil, nil, nil, refuse(http.StatusMethodNotAllowed, "this is an egress proxy: only CONNECT host:port", "Allow: CONNECT")
	}
	if who.cluster == "" {
		if who.cluster, err = s.cfg.Policy.EgressCluster(who.id); err != nil {
			metrics.Denied.WithLabelValues("Egress").Inc()
			s.cfg.Log.Warn("permission denied", "peer", who.String())
			return nil, nil, nil, refuse(http.StatusForbidden, err.Error())
		}
	}
	target, err := parseAuthority(req.RequestURI, who.cluster)
	if err != nil {
		return nil, nil, nil, refuse(http.StatusBadRequest, err.Error())
	}
	if s.cfg.Draining.Err() != nil {
		return nil, nil, nil, refuse(http.StatusServiceUnavailable, "this broker replica is shutting down: connect to another")
	}
	release, over := s.callers.Take(who.id)
	if over != quota.Under {
		metrics.LimitsHit.WithLabelValues("egress_tunnels_per_caller").Inc()
		return nil, nil, nil, refuse(http.StatusTooManyRequests, who.String()+" holds the most tunnels a caller may")
	}
	t, err := s.dial(target, who, deadline)
	if err != nil {
		release()
		return nil, nil, nil, refuse(httpStatus(status.Code(err)), status.Convert(err).Message())
	}
	return t, br, release, nil
}

// dial orders the dial of target within the connection's deadline, and
// counts and logs it as the Dial RPC does.
func (s *Server) dial(target *tunnelv1.Target, who caller, deadline time.Time) (*tunnel.Tunnel, error) {
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	t, _, failure, err := tunnel.DialCounted(ctx, s.cfg.Registry, target, nil)
	if err != nil {
		s.cfg.Log.Info("dial failed", append([]any{"target", target.Key(), "caller", who.String()}, failure...)...)
	}
	return t, err
}

// splice carries the tunnel until it ends.
func (s *Server) splice(conn net.Conn, t *tunnel.Tunnel, release func(), log *slog.Logger) {
	s.active.Add(1)
	metrics.Tunnels.Inc()
	gauge := metrics.EgressTunnels.WithLabelValues(s.cfg.Name)
	gauge.Inc()
	ended := func() {
		release()
		s.active.Add(-1)
		metrics.Tunnels.Dec()
		gauge.Dec()
	}
	metrics.TunnelsOpened.WithLabelValues("connect").Inc()
	_, agentStatus := t.SpliceConn(conn, s.cfg.Tunnels, ended)
	if agentStatus != nil {
		log.Info("tunnel ended", "agent_code", status.Code(agentStatus).String(), "error", status.Convert(agentStatus).Message())
	} else {
		log.Debug("tunnel closed")
	}
}

func (s *Server) count(code int) {
	metrics.EgressRequests.WithLabelValues(s.cfg.Name, strconv.Itoa(code)).Inc()
}

// bufferedConn reads what the request's reader holds before the
// connection: bytes a client sent right after its CONNECT.
type bufferedConn struct {
	net.Conn
	r *bufio.Reader
}

func (c *bufferedConn) Read(p []byte) (int, error) {
	if c.r != nil && c.r.Buffered() > 0 {
		return c.r.Read(p)
	}
	return c.Conn.Read(p)
}

// CloseWrite half-closes the connection, where it can.
func (c *bufferedConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}
