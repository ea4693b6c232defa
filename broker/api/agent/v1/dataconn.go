package agent

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/broker/internal/spares"
	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/broker/registry"
	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
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
// verified by the TLS handshake: it takes it as a spare of the
// registration it binds to, and while it is idle has it carry one of that
// registration's dial orders, then the dial's tunnel until the tunnel
// ends, and so on, one tunnel after another (§3.7). A refusal is the
// connection's last message.
func (s *Service) ServeData(conn net.Conn, peer identity.AuthInfo) {
	a, release, ok := s.bind(conn, peer.ID)
	for ok {
		ok = s.carryOne(conn, peer, a, release)
		if ok {
			release, ok = s.idleAgain(conn, peer.ID)
		}
	}
}

// bind takes conn as a spare of peer id, if the policy lets it register
// and the spares' bounds leave room, and reads which of its registrations
// it binds to; a refusal closes it. release stops counting the spare.
func (s *Service) bind(conn net.Conn, id spiffeid.ID) (a *registry.Agent, release func(), ok bool) {
	release, err := s.admitSpare(id)
	if err == nil {
		a, err = s.readBind(conn, id)
	}
	if err == nil {
		err = wire.WriteAccepted(conn, s.cfg.BrokerID)
	}
	if err == nil {
		return a, release, true
	}
	if release != nil {
		release()
	}
	if _, ok := status.FromError(err); ok {
		refuse(conn, err)
		return nil, nil, false
	}
	conn.Close()
	if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) && !errors.Is(err, spares.ErrDrained) {
		s.cfg.Log.Info("data connection ended before its bind", "peer", id.String(), "error", err)
	}
	return nil, nil, false
}

// refuse answers a data connection's bind with err, and closes it once
// what the agent sent is read (wire.CloseRefused): the agent sends its bind
// before the answer, and a socket closed with it unread would reset the
// connection before the agent had read why.
func refuse(conn net.Conn, err error) {
	_ = wire.WriteOpenResult(conn, err)
	wire.CloseRefused(conn)
}

// admitSpare counts one more spare of id, a new connection or one idle
// again after a tunnel, if the policy (which may have changed since) lets
// id register, the broker does not drain and no bound is reached.
func (s *Service) admitSpare(id spiffeid.ID) (release func(), err error) {
	if !s.cfg.Policy.IsAgent(id) {
		metrics.Denied.WithLabelValues(wire.DataProtocol).Inc()
		s.cfg.Log.Warn("permission denied", "peer", id.String(), "method", wire.DataProtocol)
		return nil, status.Errorf(codes.PermissionDenied, "%s may not open data connections", id)
	}
	return s.spares.Admit(id, s.cfg.Draining)
}

// readBind reads the connection's bind, however slowly it comes (the
// spare counts meanwhile), and finds the registration it names: one of
// id's on this replica. The drain ends the wait (spares.Read).
func (s *Service) readBind(conn net.Conn, id spiffeid.ID) (*registry.Agent, error) {
	session, err := spares.Read(conn, s.cfg.Draining, wire.ReadBind)
	if err != nil {
		return nil, err
	}
	a, ok := s.cfg.Registry.Session(session, id)
	if !ok {
		return nil, status.Errorf(codes.NotFound, "no registration %q of %s on this broker replica (it ended, or is another replica's)", session, id)
	}
	return a, nil
}

// idleAgain takes conn, idle after a tunnel or a failed dial, back as a
// spare of peer id, as a new one would be taken: the policy asked again,
// the bounds, the drain. Past them it closes the connection.
func (s *Service) idleAgain(conn net.Conn, id spiffeid.ID) (release func(), ok bool) {
	release, err := s.admitSpare(id)
	if err != nil {
		s.cfg.Log.Info("data connection closed after its tunnel", "peer", id.String(), "error", err)
		conn.Close()
		return nil, false
	}
	return release, true
}

// carryOne waits, while conn is idle, for a dial order of a's to carry, and
// carries it: the agent's answer, then the tunnel. It says whether the
// connection is idle again after it; if not, it has closed it.
func (s *Service) carryOne(conn net.Conn, peer identity.AuthInfo, a *registry.Agent, release func()) bool {
	c := newCarrier(conn, release)
	order, answer, ok := c.await(a, s.cfg.Draining)
	release()
	if !ok {
		conn.Close()
		return false
	}
	switch {
	case answer == nil:
		return s.carryTunnel(conn, peer, a, order)
	case isStatus(answer):
		st := status.Convert(answer)
		s.cfg.Registry.Fail(a, &tunnelv1.DialFailure{DialId: order.GetDialId(), Code: int32(st.Code()), Message: st.Message()})
		return true
	case mayResend(order, answer) && s.cfg.Registry.Resend(a, order.GetDialId()):
		s.cfg.Log.Debug("data connection ended before the agent answered its order: ordered again on the control stream", "agent", a.String(), "error", answer)
		conn.Close()
		return false
	default:
		s.cfg.Registry.Fail(a, lostBeforeAnswer(order))
		s.cfg.Log.Info("data connection failed before the agent answered its order", "agent", a.String(), "error", answer)
		tunnel.Reset(conn)
		return false
	}
}

// carryTunnel carries the tunnel of order, which the agent answered OK,
// and says whether the connection is idle after it.
func (s *Service) carryTunnel(conn net.Conn, peer identity.AuthInfo, a *registry.Agent, order *tunnelv1.DialOrder) bool {
	leg := tunnel.NewConnLeg(conn, "data_connection")
	// A tunnel has the grace of an RPC in flight when its peer's SVID
	// expires; a spare has none, and a dial answered after the expiry
	// fails as the Tunnel stream that opens it would.
	end, err := peer.Begin()
	if err != nil {
		st := status.Convert(err)
		s.cfg.Registry.Fail(a, &tunnelv1.DialFailure{DialId: order.GetDialId(), Code: int32(codes.Unavailable), Message: st.Message(),
			EarlyDataSent: len(order.GetEarlyData()) > 0})
		return leg.Finish(err)
	}
	defer end()
	err = tunnel.OpenConn(s.cfg.Registry, order.GetDialId(), peer.ID, leg)
	if status.Code(err) == codes.NotFound {
		s.cfg.Log.Info("the agent answered a dial that is no longer pending", "peer", peer.ID.String(), "dial", order.GetDialId(), "error", err)
	}
	return leg.Finish(err)
}

// mayResend says whether a dial whose data connection ended with err before
// the agent's answer may be ordered again: the agent closed the connection
// cleanly (io.EOF, its close_notify: an agent closes an idle spare it no
// longer wants, and may do so as the broker's order is on its way), so it
// sent no answer and, as it writes early data only after its answer, none
// of the dial's; or the order carried no early data, and a second one does
// no harm. Not an answer that is not one: that agent is broken.
func mayResend(order *tunnelv1.DialOrder, err error) bool {
	if errors.Is(err, wire.ErrBadAnswer) {
		return false
	}
	return errors.Is(err, io.EOF) || len(order.GetEarlyData()) == 0
}

// lostBeforeAnswer is the dial's failure when its data connection failed,
// or broke the protocol, before the agent answered: Unavailable, and not
// to be ordered again if the order carried early data, which may have
// reached the target.
func lostBeforeAnswer(order *tunnelv1.DialOrder) *tunnelv1.DialFailure {
	return &tunnelv1.DialFailure{DialId: order.GetDialId(), Code: int32(codes.Unavailable),
		Message: "the agent's data connection failed before it answered the dial", EarlyDataSent: len(order.GetEarlyData()) > 0}
}

// isStatus says whether err is the agent's answer itself, a status, rather
// than the connection's error.
func isStatus(err error) bool {
	_, ok := err.(interface{ GRPCStatus() *status.Status })
	return ok
}

// carrier is an idle data connection bound to a registration, as the
// registry's dials see it (registry.Carrier).
type carrier struct {
	conn net.Conn
	// release stops counting the connection as a spare: an order makes it
	// carry a dial.
	release func()
	ordered chan *tunnelv1.DialOrder // the one order, sent before it is written
	// written is closed once Carry is done with the connection's write
	// deadline: the tunnel that follows sets its own.
	written  chan struct{}
	dropped  chan struct{} // closed by Drop
	dropOnce sync.Once
}

func newCarrier(conn net.Conn, release func()) *carrier {
	return &carrier{conn: conn, release: release, ordered: make(chan *tunnelv1.DialOrder, 1),
		written: make(chan struct{}), dropped: make(chan struct{})}
}

// maxOrderWait bounds the write of an order that carries no timeout, and
// the wait for its answer.
const maxOrderWait = 5 * time.Second

// Carry writes order on the connection, in the dial's goroutine: no
// hand-off between it and the socket. An agent that reads nothing holds
// it no longer than the order's timeout; a write cut short resets the
// connection, whose goroutine then fails the dial. The answer must come
// within the timeout and wire.EndTimeout more, as an honest agent's
// failure comes at the timeout: the connection is no longer a spare, and
// one whose agent never answers would otherwise be held for good.
func (c *carrier) Carry(order *tunnelv1.DialOrder) {
	c.release()
	c.ordered <- order
	defer close(c.written)
	timeout := time.Duration(order.GetTimeoutMs()) * time.Millisecond
	if timeout <= 0 {
		timeout = maxOrderWait
	}
	deadline := time.Now().Add(timeout)
	_ = c.conn.SetReadDeadline(deadline.Add(wire.EndTimeout))
	_ = c.conn.SetWriteDeadline(deadline)
	if err := wire.WriteOrder(c.conn, order); err != nil {
		tunnel.Reset(c.conn)
		return
	}
	_ = c.conn.SetWriteDeadline(time.Time{})
}

// Drop closes the idle connection, with a close_notify: its registration
// has ended, or the broker drains.
func (c *carrier) Drop() {
	c.dropOnce.Do(func() {
		close(c.dropped)
		c.conn.Close()
	})
}

// await makes the connection one of a's carriers until an order takes it,
// and returns the order with the agent's answer (nil: OK); ok is false if
// the connection ended idle: the agent closed it or sent something unasked,
// its registration ended, or the broker drains. The drain closes an idle
// carrier with a close_notify.
func (c *carrier) await(a *registry.Agent, draining context.Context) (order *tunnelv1.DialOrder, answer error, ok bool) {
	if !a.AddCarrier(c) {
		return nil, nil, false
	}
	stop := context.AfterFunc(draining, func() {
		if a.RemoveCarrier(c) {
			c.Drop()
		}
	})
	defer stop()
	answer = wire.ReadAnswer(c.conn)
	if a.RemoveCarrier(c) {
		return nil, nil, false
	}
	select {
	case order = <-c.ordered:
		// The agent may answer before Carry has cleared its write
		// deadline, which would then clear the tunnel's.
		<-c.written
		_ = c.conn.SetReadDeadline(time.Time{})
		return order, answer, true
	case <-c.dropped:
		return nil, nil, false
	}
}
