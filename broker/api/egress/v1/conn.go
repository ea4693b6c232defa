package egress

import (
	"bufio"
	"context"
	"errors"
	"net"
	"net/http"
	"strconv"
	"time"

	"go.opentelemetry.io/otel/propagation"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/broker/admission"
	"github.com/kcp-dev/tunnel-broker/broker/authz"
	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
	"github.com/kcp-dev/tunnel-broker/internal/splice"
	"github.com/kcp-dev/tunnel-broker/internal/tracing"
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
	accepted := time.Now()
	deadline := accepted.Add(s.cfg.Timeout)
	_ = raw.SetDeadline(deadline)
	conn, who, err := s.handshake(raw, accepted, deadline)
	if errors.Is(err, errNoOpening) {
		noOpening()
		return
	}
	if err != nil {
		s.count(0)
		return
	}
	t, ticket, br, err := s.open(conn, who, deadline)
	s.releaseOpening()
	if ticket != nil {
		defer ticket.Release()
	}
	if r, ok := errors.AsType[*refusal](err); ok {
		s.count(r.code)
		_ = reply(conn, r.code, r.reason, r.header...)
		return
	}
	if _, err := conn.Write([]byte(established)); err != nil {
		s.count(0)
		t.End(status.Error(codes.Canceled, "the CONNECT client went away before its answer"))
		return
	}
	s.count(http.StatusOK)
	_ = conn.SetDeadline(time.Time{})
	gauge := metrics.EgressTunnels.WithLabelValues(s.cfg.Name)
	gauge.Inc()
	defer gauge.Dec()
	ticket.Splice(t, splice.NewConnLeg(&bufferedConn{Conn: conn, r: br}, 0), "connect")
}

// open reads the CONNECT and dials its target through the front door: the
// tunnel, the ticket that counts it against its caller, and what the
// client sent after its request; or a refusal.
func (s *Server) open(conn net.Conn, who caller, deadline time.Time) (*tunnel.Tunnel, *admission.Ticket, *bufio.Reader, error) {
	req, br, err := readRequest(conn, s.cfg.MaxHeaderBytes)
	if err != nil {
		return nil, nil, nil, refuse(http.StatusBadRequest, err.Error())
	}
	if req.Method != http.MethodConnect {
		return nil, nil, nil, refuse(http.StatusMethodNotAllowed, "this is an egress proxy: only CONNECT host:port", "Allow: CONNECT")
	}
	if who.cluster == "" {
		if who.cluster, err = s.cfg.Policy.EgressCluster(who.id); err != nil {
			denied := authz.Deny(s.cfg.Log, who.String(), authz.AskedEgress, err.Error())
			return nil, nil, nil, refuse(http.StatusForbidden, status.Convert(denied).Message())
		}
	}
	target, err := parseAuthority(req.RequestURI, who.cluster)
	if err != nil {
		return nil, nil, nil, refuse(http.StatusBadRequest, err.Error())
	}
	// kube-apiserver sends no trace context with its CONNECT; another
	// client may, in the request's traceparent header.
	ticket, err := s.cfg.Admission.Hold(tracing.FromFields(context.Background(), propagation.HeaderCarrier(req.Header)), who.admitted())
	if err != nil {
		return nil, nil, nil, refuse(httpStatus(status.Code(err)), status.Convert(err).Message())
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	t, err := ticket.Dial(ctx, target, nil)
	if err != nil {
		return nil, ticket, nil, refuse(httpStatus(status.Code(err)), status.Convert(err).Message())
	}
	return t, ticket, br, nil
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

// NetConn is the connection under the reader, for splice.Reset.
func (c *bufferedConn) NetConn() net.Conn { return c.Conn }

// CloseWrite half-closes the connection, where it can.
func (c *bufferedConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}
