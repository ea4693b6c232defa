package kcpplugin

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/credentials"

	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// DefaultSpares is how many dial connections a Dialer keeps open ahead of
// its dials when DialConnections.Spares is zero.
const DefaultSpares = 4

// DialConnections has a Dialer carry tunnels on TLS connections of their
// own to the broker (docs/protocol.md §3.6) instead of Dial streams: a
// tunnel's bytes then cross the broker without gRPC, which takes about half
// of a small round trip's cost through the broker. The Dialer keeps Spares
// of them open and verified ahead of its dials, and dials on a Dial stream
// whenever it has none left, or the broker does not accept them.
type DialConnections struct {
	// Address is the broker's gRPC port, host:port: the replicas the gRPC
	// connection's target names. Any replica serves any dial.
	Address string
	// TLS is the client side of SPIFFE mTLS, as for the gRPC connection:
	// e.g. go-spiffe's tlsconfig.MTLSClientConfig(svid, bundle,
	// tlsconfig.AuthorizeID(brokerID)). The Dialer sets the ALPN protocol
	// on a copy, and the server name from Address if it is empty.
	TLS *tls.Config
	// Spares is how many connections are kept open ahead of dials (zero:
	// DefaultSpares). Each is a socket and a goroutine here, and holds one
	// of the broker's --max-spare-dial-connections-per-peer.
	Spares int
}

// Option configures a Dialer.
type Option func(*Dialer)

// WithDialConnections has the Dialer carry its tunnels on dial connections
// (DialConnections). Close the Dialer to close them.
func WithDialConnections(dc DialConnections) Option {
	return func(d *Dialer) { d.spares = newSpares(dc) }
}

// spareHandshakeTimeout bounds a dial connection's connect, TLS handshake
// and the broker's acceptance.
const spareHandshakeTimeout = 10 * time.Second

// The backoff after a spare could not be opened or was lost before use.
const (
	minSpareRetry = 100 * time.Millisecond
	maxSpareRetry = 30 * time.Second
)

// errNotAccepted is a broker whose handshake did not pick the dial
// protocol: an older one, or something else on that address.
var errNotAccepted = errors.New("the broker's TLS handshake did not pick " + wire.DialProtocol)

// Where a spare is in its life: idle in the pool, taken by a dial, or lost
// (closed by the broker, failed, or closed by the pool).
const (
	spareIdle int32 = iota
	spareTaken
	spareLost
)

// spare is one dial connection, accepted by the broker, that no dial has
// used yet. A goroutine of its own (watch) is blocked reading the broker's
// answer to a dial not sent yet: the broker sends nothing before it, so a
// read that ends while the spare is idle means it is lost, and after the
// spare is taken the read is the dial's answer.
type spare struct {
	conn  net.Conn     // TLS; its CloseWrite sends close_notify
	sock  *wire.Socket // under conn: to reset it
	state atomic.Int32
	// dial hands the watching goroutine the conn that took the spare.
	dial chan *directConn
}

// abort resets the connection: no close_notify, which would say that the
// caller's direction ended cleanly.
func (s *spare) abort() {
	_ = s.sock.SetLinger(0)
	_ = s.sock.Close()
}

// spares keeps up to want dial connections open, replacing each one taken
// or lost at once, one handshake at a time, and after a failure no sooner
// than a backoff allows, until it is closed.
type spares struct {
	addr  string
	creds credentials.TransportCredentials
	// authority is the server name for the handshake: TLS.ServerName, or
	// Address's host.
	authority string
	want      int
	ctx       context.Context
	cancel    context.CancelFunc
	wake      chan struct{} // a spare was taken or lost
	done      chan struct{} // fill has returned
	watchers  sync.WaitGroup

	mu     sync.Mutex
	idle   []*spare
	closed bool
	// lost and taken say what happened since fill last looked.
	lost, taken bool
}

func newSpares(dc DialConnections) *spares {
	cfg := dc.TLS.Clone()
	cfg.NextProtos = []string{wire.DialProtocol}
	host, _, err := net.SplitHostPort(dc.Address)
	if err != nil {
		host = dc.Address
	}
	if cfg.ServerName == "" {
		cfg.ServerName = host
	}
	ctx, cancel := context.WithCancel(context.Background())
	// gRPC's handshake takes the server name from the authority.
	p := &spares{addr: dc.Address, creds: wire.CoalesceWrites(credentials.NewTLS(cfg)), authority: cfg.ServerName,
		want: dc.Spares, ctx: ctx, cancel: cancel, wake: make(chan struct{}, 1), done: make(chan struct{})}
	if p.want <= 0 {
		p.want = DefaultSpares
	}
	go p.fill()
	return p
}

// close closes the idle spares and waits for their goroutines; taken ones
// are their conns'.
func (p *spares) close() {
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

// fill opens spares while there are fewer than wanted. After a failure (a
// handshake, or a spare lost before use) it waits a backoff that doubles up
// to maxSpareRetry until a spare is used, so that a broker that refuses
// them, or an older one, is not asked again at once forever.
func (p *spares) fill() {
	defer close(p.done)
	defer p.closeAll()
	retry := minSpareRetry
	failed := false
	for p.waitForRoom() {
		lost, taken := p.news()
		if taken {
			retry = minSpareRetry
		}
		if failed || lost {
			if !p.sleep(retry) {
				return
			}
			retry = min(2*retry, maxSpareRetry)
		}
		failed = p.add() != nil
		if p.ctx.Err() != nil {
			return
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
// once it is closed.
func (p *spares) waitForRoom() bool {
	for {
		p.mu.Lock()
		room := len(p.idle) < p.want
		p.mu.Unlock()
		if room {
			return p.ctx.Err() == nil
		}
		select {
		case <-p.wake:
		case <-p.ctx.Done():
			return false
		}
	}
}

// sleep waits d; false if the pool is closed first.
func (p *spares) sleep(d time.Duration) bool {
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
		return true
	case <-p.ctx.Done():
		return false
	}
}

// add opens a spare and puts it in the pool, watched.
func (p *spares) add() error {
	s, err := p.open()
	if err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		s.conn.Close()
		return nil
	}
	p.idle = append(p.idle, s)
	p.watchers.Add(1)
	go p.watch(s)
	return nil
}

// open connects to the broker, does the TLS handshake, which must pick the
// dial protocol, and reads the broker's acceptance.
func (p *spares) open() (*spare, error) {
	ctx, cancel := context.WithTimeout(p.ctx, spareHandshakeTimeout)
	defer cancel()
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", p.addr)
	if err != nil {
		return nil, err
	}
	sock := &wire.Socket{Conn: c}
	conn, info, err := p.creds.ClientHandshake(ctx, p.authority, sock)
	if err != nil {
		sock.Close()
		return nil, err
	}
	if tlsInfo, ok := info.(credentials.TLSInfo); !ok || tlsInfo.State.NegotiatedProtocol != wire.DialProtocol {
		conn.Close()
		return nil, errNotAccepted
	}
	conn = wire.CloseNotified(conn, sock)
	deadline, _ := ctx.Deadline()
	_ = sock.SetReadDeadline(deadline)
	_, err = wire.ReadAccepted(conn)
	_ = sock.SetReadDeadline(time.Time{})
	if err != nil {
		conn.Close()
		return nil, err
	}
	return &spare{conn: conn, sock: sock, dial: make(chan *directConn, 1)}, nil
}

// watch waits for the broker's answer on s. Before s is taken, the read
// ending means s is lost; after, it is the answer to the dial of the conn
// that took s.
func (p *spares) watch(s *spare) {
	defer p.watchers.Done()
	tunnelID, err := wire.ReadDialResult(s.conn)
	if s.state.CompareAndSwap(spareIdle, spareLost) {
		p.lose(s)
		return
	}
	if s.state.Load() != spareTaken {
		return // closed by the pool
	}
	if c := <-s.dial; c != nil {
		c.answer(tunnelID, err)
	}
}

// lose drops a spare that ended before it was taken, and has it replaced.
func (p *spares) lose(s *spare) {
	p.mu.Lock()
	p.idle = slices.DeleteFunc(p.idle, func(i *spare) bool { return i == s })
	p.lost = true
	p.mu.Unlock()
	s.conn.Close()
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
