package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"time"

	"golang.org/x/time/rate"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"k8s.io/utils/clock"

	"github.com/kcp-dev/tunnel-broker/internal/identity"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// sparesPerSecond bounds how many data connections one session opens a
// second (docs/protocol.md §3.5): a burst of dials that uses up the spares
// costs the broker no more handshakes than that.
const sparesPerSecond = 10

// dataHandshakeTimeout bounds a data connection's connect and TLS
// handshake, as the broker's --handshake-timeout does on its side.
const dataHandshakeTimeout = 10 * time.Second

// errNotAccepted is a broker that set data_connections but whose handshake
// did not pick the data protocol, or whose data connections reach another
// replica: its address leads elsewhere than its control stream's (a load
// balancer), or to an older replica.
var errNotAccepted = errors.New("the broker's TLS handshake did not pick " + wire.DataProtocol)

// spare is one data connection bound to a session (docs/protocol.md
// §3.5), idle: opened ahead of a dial, or given back once its tunnel ended
// (§3.7). The pool's goroutine watching it (wire.Spares) is blocked
// reading the broker's next dial order: a read that ends without one
// means the spare is lost; with one, the goroutine serves the order
// (spareDialer.serve) and goes on as the tunnel's copier from the broker
// to the target.
type spare struct {
	// conn's io.EOF is the broker's close_notify (wire.CloseNotified):
	// the log of a spare lost while idle says whether the broker closed
	// it or its socket just ended. Once the agent has answered an order
	// OK, the tunnel's frames say how it ends.
	conn net.Conn
	raw  *wire.Socket // under conn: to abort without a close_notify
}

// abort resets the connection: no close_notify, which would say that the
// agent closed it cleanly, while idle.
func (s *spare) abort() {
	_ = s.raw.SetLinger(0)
	_ = s.raw.Close()
}

// reset aborts the connection and closes it: done with it for good.
func (s *spare) reset() {
	s.abort()
	s.conn.Close()
}

// spareAnswer is what the goroutine watching an idle spare read: the
// broker's dial order, or why the connection ended without one.
type spareAnswer struct {
	order *tunnelv1.DialOrder
	err   error
}

// readOrder waits on an idle spare for the broker's next dial order.
func readOrder(s *spare) spareAnswer {
	order, err := wire.ReadOrder(s.conn)
	return spareAnswer{order: order, err: err}
}

// takenSpare is a spare whose order the agent serves: it goes back to the
// pool idle (Return), or is closed.
type takenSpare = wire.Spare[*spare, spareAnswer]

// spares are a session's spare data connections: up to
// SpareDataConnections of them idle, opened at most sparesPerSecond a
// second, replacing those the broker takes with an order or loses, for as
// long as the session lasts and the agent does not drain. A tunnel that
// ends and leaves its connection idle gives it back (spareDialer.carry),
// and the pool keeps it instead of opening another, or closes it if it
// holds enough. Nil holds none.
type spares = wire.Spares[*spare, spareAnswer]

// spareDialer opens a session's spares, logs what becomes of them, and
// serves the orders the broker sends on them.
type spareDialer struct {
	run *agentRun
	// session is the session's context: an order read on a spare once
	// it has ended is refused (admit).
	session context.Context
	// addr is the address of the session's gRPC connection: a session
	// belongs to the replica that registered it, and a name may resolve
	// to several.
	addr, authority string
	// sessionID is what each spare's bind names, and brokerID the
	// replica of the session, which every spare must reach.
	sessionID, brokerID string
	log                 *slog.Logger
}

// startSpares keeps spares for the session of stream while the broker
// accepts data connections and the agent is set to use them; nil
// otherwise, which holds none. The broker then orders every dial on the
// control stream.
func (r *agentRun) startSpares(ctx context.Context, stream tunnelv1.AgentService_ConnectClient, confirmed *tunnelv1.Registered) *spares {
	if r.DataCredentials == nil || r.SpareDataConnections <= 0 || !confirmed.GetDataConnections() {
		return nil
	}
	if confirmed.GetSessionId() == "" {
		r.Log.Info("the broker names no session for data connections to bind to: its tunnels go on Tunnel streams", "broker", r.Broker)
		return nil
	}
	addr := r.Broker
	if p, ok := peer.FromContext(stream.Context()); ok && p.Addr != nil {
		addr = p.Addr.String()
	}
	// The server name gRPC's handshake uses too.
	authority := r.Broker
	if host, _, err := net.SplitHostPort(r.Broker); err == nil {
		authority = host
	}
	d := &spareDialer{run: r, session: ctx, addr: addr, authority: authority, sessionID: confirmed.GetSessionId(),
		brokerID: confirmed.GetBrokerId(), log: r.Log.With("broker", r.Broker)}
	clk := r.clock()
	return wire.NewSpares(ctx, wire.SparesConfig[*spare, spareAnswer]{
		Want:      r.SpareDataConnections,
		Open:      d.open,
		Read:      readOrder,
		Close:     func(s *spare) { s.conn.Close() },
		Lost:      d.lost,
		Taken:     func(a spareAnswer) bool { return a.order != nil },
		Serve:     func(p *spares, s *takenSpare, a spareAnswer) { d.serve(p, s, a.order) },
		Pace:      sparePace(clk, r.SpareDataConnections),
		AfterTake: wire.ReplaceAfterTake,
		After:     clk.After,
		Stop:      r.draining,
	})
}

// sparePace opens spares at the limiter's pace, and after a failure (a
// handshake, or a spare lost) no sooner than the backoff says, so that a
// broker that refuses them is not asked ten times a second forever; a
// spare taken resets the backoff.
func sparePace(clk clock.PassiveClock, want int) func(taken, setback bool) time.Duration {
	limit := rate.NewLimiter(sparesPerSecond, min(want, sparesPerSecond))
	retry := newBackoff(minRetry, maxRetry)
	return func(taken, setback bool) time.Duration {
		if taken {
			retry.reset()
		}
		now := clk.Now()
		wait := limit.ReserveN(now, 1).DelayFrom(now)
		if setback {
			wait = max(wait, retry.next())
		}
		return wait
	}
}

// open opens a spare, and logs why not unless the session ended. A broker
// that does not take data connections after all ends the filling.
func (d *spareDialer) open(ctx context.Context) (*spare, error) {
	s, err := d.dial(ctx)
	switch {
	case err == nil || ctx.Err() != nil:
	case errors.Is(err, errNotAccepted):
		d.log.Info("the broker does not accept data connections after all: its tunnels go on Tunnel streams", "address", d.addr, "error", err)
		err = fmt.Errorf("%w: %w", wire.ErrSparesRefused, err)
	default:
		d.log.Info("could not open a spare data connection", "address", d.addr, "error", err)
	}
	return s, err
}

// lost logs a spare that ended while idle, and why.
func (d *spareDialer) lost(a spareAnswer) {
	why := a.err.Error()
	if errors.Is(a.err, io.EOF) {
		why = "the broker closed it (close_notify): it drains, the session ended, or it holds enough spares"
	}
	d.log.Info("spare data connection lost, opening another", "address", d.addr, "error", why)
}

// dial connects to the replica, does the TLS handshake, which must pick
// the data protocol, and binds the connection to the session.
func (d *spareDialer) dial(ctx context.Context) (*spare, error) {
	ctx, cancel := context.WithTimeout(ctx, dataHandshakeTimeout)
	defer cancel()
	var nd net.Dialer
	c, err := nd.DialContext(ctx, "tcp", d.addr)
	if err != nil {
		return nil, err
	}
	raw := &wire.Socket{Conn: c}
	conn, info, err := d.run.DataCredentials.ClientHandshake(ctx, d.authority, raw)
	if err != nil {
		raw.Close()
		return nil, err
	}
	if negotiated(info) != wire.DataProtocol {
		conn.Close()
		return nil, errNotAccepted
	}
	dc := wire.CloseNotified(conn, raw)
	// The bind names the session whose orders the spare takes; the
	// broker answers with its replica. A replica other than the control
	// stream's (through a load balancer) refuses the bind, as it knows
	// no such session, or names itself.
	if err := wire.WriteBind(dc, d.sessionID); err != nil {
		conn.Close()
		return nil, err
	}
	id, err := wire.AwaitAccepted(ctx, dc, raw)
	if err != nil {
		conn.Close()
		return nil, err
	}
	if id != d.brokerID {
		conn.Close()
		return nil, fmt.Errorf("%w: the data connection reached replica %q, the control stream %q", errNotAccepted, id, d.brokerID)
	}
	return &spare{conn: dc, raw: raw}, nil
}

// negotiated is the ALPN protocol a handshake picked.
func negotiated(info credentials.AuthInfo) string {
	switch i := info.(type) {
	case identity.AuthInfo:
		return i.State.NegotiatedProtocol
	case credentials.TLSInfo:
		return i.State.NegotiatedProtocol
	}
	return ""
}
