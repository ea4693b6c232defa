package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/time/rate"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"

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

// Where a spare is in its life: idle in the pool, taken by a tunnel, or
// lost (closed by the broker, failed, or closed by the pool).
const (
	spareIdle int32 = iota
	spareTaken
	spareLost
)

// dataConn is a data connection: TLS, whose CloseWrite sends close_notify.
type dataConn interface {
	net.Conn
	CloseWrite() error
}

// spare is one data connection opened ahead of a dial. A goroutine of its
// own (watch) is blocked reading the broker's answer to an open not sent
// yet. The broker sends nothing before that answer, so a read that ends
// before the spare is taken means the spare is lost; after, the read is the
// tunnel's answer, and the goroutine goes on as the tunnel's copier from
// the broker to the target.
type spare struct {
	// conn's io.EOF is the broker's close_notify (wire.CloseNotified).
	conn  dataConn
	raw   *wire.Socket // under conn: to abort without a close_notify
	state atomic.Int32
	// tunnel hands the watching goroutine the tunnel that took the spare,
	// or nil if none is to be carried after all.
	tunnel chan *dataTunnel
}

// abort resets the connection: no close_notify, which would say that the
// agent's direction ended cleanly.
func (s *spare) abort() {
	_ = s.raw.SetLinger(0)
	_ = s.raw.Close()
}

// spares are a session's spare data connections: up to want of them,
// opened at most sparesPerSecond a second, replacing those taken or lost,
// for as long as the session lasts and the agent does not drain.
type spares struct {
	run *agentRun
	// addr is the address of the session's gRPC connection: a dial id
	// belongs to the replica that ordered it, and a name may resolve to
	// several.
	addr, authority string
	// brokerID is the replica of the session, which every spare must
	// reach: a dial id belongs to it.
	brokerID string
	want     int
	log      *slog.Logger
	ctx      context.Context
	cancel   context.CancelFunc
	wake     chan struct{} // a spare was taken or lost
	done     chan struct{} // fill has returned
	watchers sync.WaitGroup

	mu     sync.Mutex
	idle   []*spare
	closed bool
	// lost and taken say what happened since fill last looked.
	lost, taken bool
}

// startSpares keeps spares for the session of stream while the broker
// accepts data connections and the agent is set to use them; nil
// otherwise, which takes none.
func (r *agentRun) startSpares(ctx context.Context, stream tunnelv1.AgentService_ConnectClient, confirmed *tunnelv1.Registered) *spares {
	if r.DataCredentials == nil || r.SpareDataConnections <= 0 || !confirmed.GetDataConnections() {
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
	ctx, cancel := context.WithCancel(ctx)
	p := &spares{run: r, addr: addr, authority: authority, brokerID: confirmed.GetBrokerId(), want: r.SpareDataConnections,
		log: r.Log.With("broker", r.Broker), ctx: ctx, cancel: cancel,
		wake: make(chan struct{}, 1), done: make(chan struct{})}
	go p.fill()
	return p
}

// stop closes the spares and waits for their goroutines; taken ones are
// their tunnels'.
func (p *spares) stop() {
	if p == nil {
		return
	}
	p.cancel()
	<-p.done
	p.watchers.Wait()
}

// take returns an idle spare, now the caller's, or nil if there is none.
func (p *spares) take() *spare {
	if p == nil {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for !p.closed && len(p.idle) > 0 {
		s := p.idle[0]
		p.idle = slices.Delete(p.idle, 0, 1)
		// A spare whose broker just closed it is being lost: skip it.
		if s.state.CompareAndSwap(spareIdle, spareTaken) {
			p.taken = true
			p.signal()
			return s
		}
	}
	return nil
}

func (p *spares) signal() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// fill opens spares while there are fewer than wanted, at the limiter's
// pace, and after a failure (a handshake, or a spare lost) no sooner than
// the backoff says, so that a broker that refuses them is not asked ten
// times a second forever. When the session ends or the agent drains, it
// closes the spares left.
func (p *spares) fill() {
	defer close(p.done)
	defer p.closeAll()
	limit := rate.NewLimiter(sparesPerSecond, min(p.want, sparesPerSecond))
	retry := newBackoff(minRetry, maxRetry)
	failed := false
	for p.waitForRoom() {
		lost, taken := p.news()
		if taken {
			retry.reset()
		}
		now := p.run.clock().Now()
		wait := limit.ReserveN(now, 1).DelayFrom(now)
		if failed || lost {
			wait = max(wait, retry.next())
		}
		if !p.sleep(wait) {
			return
		}
		err := p.add()
		if p.ctx.Err() != nil {
			return
		}
		if errors.Is(err, errNotAccepted) {
			p.log.Info("the broker does not accept data connections after all: its tunnels go on Tunnel streams", "address", p.addr, "error", err)
			return
		}
		if failed = err != nil; failed {
			p.log.Info("could not open a spare data connection", "address", p.addr, "error", err)
		}
	}
}

// news reads and clears what happened to the spares since the last call.
func (p *spares) news() (lost, taken bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	lost, taken = p.lost, p.taken
	p.lost, p.taken = false, false
	return lost, taken
}

// waitForRoom waits until the pool holds fewer spares than wanted; false
// once the session ends or the agent drains.
func (p *spares) waitForRoom() bool {
	for {
		p.mu.Lock()
		room := len(p.idle) < p.want
		p.mu.Unlock()
		if room {
			return p.sleep(0)
		}
		select {
		case <-p.wake:
		case <-p.ctx.Done():
			return false
		case <-p.run.draining:
			return false
		}
	}
}

// sleep waits d; false if the session ends or the agent drains first.
func (p *spares) sleep(d time.Duration) bool {
	select {
	case <-p.ctx.Done():
		return false
	case <-p.run.draining:
		return false
	default:
	}
	if d <= 0 {
		return true
	}
	timer := p.run.clock().NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C():
		return true
	case <-p.ctx.Done():
		return false
	case <-p.run.draining:
		return false
	}
}

// add opens a spare and puts it in the pool, watched.
func (p *spares) add() error {
	s, err := p.dial()
	if err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.idle = append(p.idle, s)
	p.watchers.Add(1)
	go p.watch(s)
	return nil
}

// dial connects to the replica and does the TLS handshake, which must pick
// the data protocol.
func (p *spares) dial() (*spare, error) {
	ctx, cancel := context.WithTimeout(p.ctx, dataHandshakeTimeout)
	defer cancel()
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", p.addr)
	if err != nil {
		return nil, err
	}
	raw := &wire.Socket{Conn: c}
	conn, info, err := p.run.DataCredentials.ClientHandshake(ctx, p.authority, raw)
	if err != nil {
		raw.Close()
		return nil, err
	}
	if negotiated(info) != wire.DataProtocol {
		conn.Close()
		return nil, errNotAccepted
	}
	if _, ok := conn.(interface{ CloseWrite() error }); !ok {
		conn.Close()
		return nil, fmt.Errorf("a %T cannot half-close: the data credentials must be wrapped with wire.CoalesceWrites", conn)
	}
	dc := wire.CloseNotified(conn, raw).(dataConn)
	// The broker names its replica first. A spare that reached another
	// replica than the control stream's (through a load balancer) could
	// claim none of the session's dials.
	if deadline, ok := ctx.Deadline(); ok {
		_ = raw.SetReadDeadline(deadline)
	}
	id, err := wire.ReadAccepted(dc)
	_ = raw.SetReadDeadline(time.Time{})
	if err != nil {
		conn.Close()
		return nil, err
	}
	if id != p.brokerID {
		conn.Close()
		return nil, fmt.Errorf("%w: the data connection reached replica %q, the control stream %q", errNotAccepted, id, p.brokerID)
	}
	return &spare{conn: dc, raw: raw, tunnel: make(chan *dataTunnel, 1)}, nil
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

// watch waits for the broker's answer on s. Before s is taken, the read
// ending means s is lost; after, the answer is the tunnel's, which the
// goroutine goes on to carry.
func (p *spares) watch(s *spare) {
	answer := wire.ReadOpenResult(s.conn)
	if s.state.CompareAndSwap(spareIdle, spareLost) {
		p.lose(s, answer)
	}
	p.watchers.Done()
	if s.state.Load() != spareTaken {
		return
	}
	if t := <-s.tunnel; t != nil {
		t.down(answer)
	}
}

// lose drops a spare that ended before it was taken, and has it replaced.
func (p *spares) lose(s *spare, err error) {
	p.mu.Lock()
	p.idle = slices.DeleteFunc(p.idle, func(i *spare) bool { return i == s })
	p.lost = true
	p.mu.Unlock()
	s.conn.Close()
	if err == nil {
		err = errors.New("protocol error: the broker answered an open that was not sent")
	}
	p.log.Info("spare data connection lost, opening another", "address", p.addr, "error", err)
	p.signal()
}

// closeAll closes the idle spares, and has take find none from now on.
func (p *spares) closeAll() {
	p.mu.Lock()
	idle := p.idle
	p.idle, p.closed = nil, true
	p.mu.Unlock()
	for _, s := range idle {
		if s.state.CompareAndSwap(spareIdle, spareLost) {
			s.conn.Close()
		}
	}
}
