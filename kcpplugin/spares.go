package kcpplugin

import (
	"context"
	"crypto/tls"
	"errors"
	"log/slog"
	"net"
	"time"

	"golang.org/x/time/rate"
	"google.golang.org/grpc/credentials"

	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// DefaultSpares is how many dial connections a Dialer keeps open ahead of
// its dials when DialConnections.Spares is zero: a burst of that many new
// connections rides on them, and the Dialer opens at most 10 more a second.
const DefaultSpares = 16

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
	// Log, if set, hears why a spare could not be opened (the broker
	// refused it, an older broker did not pick the dial protocol, the
	// handshake failed) or was lost before use, once per attempt: the
	// attempts back off to one in 30 s. Dials meanwhile go on Dial
	// streams. kcp can pass slog.New(logr.ToSlogHandler(klog.Background())).
	Log *slog.Logger
}

// Option configures a Dialer.
type Option func(*Dialer)

// WithDialConnections has the Dialer carry its tunnels on dial connections
// (DialConnections). Close the Dialer to close them.
func WithDialConnections(dc DialConnections) Option {
	return func(d *Dialer) { d.spares, d.live = newSpares(dc), &liveConns{} }
}

// sparesPerSecond bounds how many spares a Dialer opens a second, once its
// first Spares are open (sparePace).
const sparesPerSecond = 10

// spareHandshakeTimeout bounds a dial connection's connect, TLS handshake
// and the broker's acceptance; a var so that tests can shorten it.
var spareHandshakeTimeout = 10 * time.Second

// The backoff after a spare could not be opened or was lost before use.
const (
	minSpareRetry = 100 * time.Millisecond
	maxSpareRetry = 30 * time.Second
)

// errNotAccepted is a broker whose handshake did not pick the dial
// protocol: an older one, or something else on that address.
var errNotAccepted = errors.New("the broker's TLS handshake did not pick " + wire.DialProtocol)

// spare is one dial connection, accepted by the broker. The pool's
// goroutine watching it (wire.Spares) is blocked reading the broker's
// answer to a dial not sent yet: the broker sends nothing before it, so a
// read that ends while the spare is idle means it is lost, and after the
// spare is taken the read is the dial's answer. A connection whose tunnel
// has left it idle comes back (Spares.Return), watched anew for the next
// dial's answer.
type spare struct {
	conn net.Conn     // TLS, under wire.CloseNotified
	sock *wire.Socket // under conn: to reset it
}

// abort resets the connection, which then carries nothing more: a
// broker that reads it mid-tunnel fails the tunnel at once, with no end
// exchange (docs/protocol.md §3.7), and a dial still unanswered at once.
func (s *spare) abort() {
	_ = s.sock.SetLinger(0)
	_ = s.sock.Close()
}

// spares keeps up to DialConnections.Spares dial connections open,
// replacing each one lost at once and each one taken 20 ms later
// (wire.ReplaceAfterTake) unless its tunnel has given it back by then,
// one handshake at a time, and after a failure no sooner than a backoff
// allows, until it is closed.
// Nil takes none.
type spares = wire.Spares[*spare, error]

// spareReplaceAfterTake is the pool's wire.SparesConfig.AfterTake; a var
// so that tests can lengthen it, and see a tunnel give its connection
// back before any replacement is opened.
var spareReplaceAfterTake = wire.ReplaceAfterTake

// spareDialer opens dial connections to the broker.
type spareDialer struct {
	addr  string
	creds credentials.TransportCredentials
	// authority is the server name for the handshake: TLS.ServerName, or
	// Address's host.
	authority string
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
	// gRPC's handshake takes the server name from the authority.
	d := &spareDialer{addr: dc.Address, creds: wire.CoalesceWrites(credentials.NewTLS(cfg)), authority: cfg.ServerName}
	want := dc.Spares
	if want <= 0 {
		want = DefaultSpares
	}
	return wire.NewSpares(context.Background(), wire.SparesConfig[*spare, error]{
		Want: want,
		Open: func(ctx context.Context) (*spare, error) {
			s, err := d.open(ctx)
			if err != nil && ctx.Err() == nil && dc.Log != nil {
				dc.Log.Info("kcpplugin: could not open a dial connection; dials go on Dial streams meanwhile", "address", dc.Address, "error", err)
			}
			return s, err
		},
		// The broker's answer to the dial: nil, and the tunnel's bytes
		// follow, or why not.
		Read: func(s *spare) error {
			_, err := wire.ReadDialResult(s.conn)
			return err
		},
		Close: func(s *spare) { s.conn.Close() },
		Lost: func(err error) {
			if dc.Log != nil {
				dc.Log.Info("kcpplugin: a spare dial connection ended before use", "address", dc.Address, "error", err)
			}
		},
		Pace:      sparePace(want),
		AfterTake: spareReplaceAfterTake,
	})
}

// sparePace opens spares at most sparesPerSecond a second, after a burst
// of want, and after a failure (a handshake, or a spare lost before use) no
// sooner than a backoff that doubles up to maxSpareRetry until a spare is
// used, so that a broker that refuses them, or an older one, is not asked
// again at once forever.
//
// Each spare is a TLS handshake, about 0.7 ms of CPU on each side here
// (BENCHMARKS.md): a caller that opens connections faster than that takes
// its spares and then dials on Dial streams, which cost no handshake,
// rather than paying one per connection.
func sparePace(want int) func(taken, setback bool) time.Duration {
	limit := rate.NewLimiter(sparesPerSecond, want)
	retry := minSpareRetry
	return func(taken, setback bool) time.Duration {
		if taken {
			retry = minSpareRetry
		}
		now := time.Now()
		wait := limit.ReserveN(now, 1).DelayFrom(now)
		if setback {
			wait = max(wait, retry)
			retry = min(2*retry, maxSpareRetry)
		}
		return wait
	}
}

// open connects to the broker, does the TLS handshake, which must pick the
// dial protocol, and reads the broker's acceptance.
func (d *spareDialer) open(ctx context.Context) (*spare, error) {
	ctx, cancel := context.WithTimeout(ctx, spareHandshakeTimeout)
	defer cancel()
	var nd net.Dialer
	c, err := nd.DialContext(ctx, "tcp", d.addr)
	if err != nil {
		return nil, err
	}
	sock := &wire.Socket{Conn: c}
	conn, info, err := d.creds.ClientHandshake(ctx, d.authority, sock)
	if err != nil {
		sock.Close()
		return nil, err
	}
	if tlsInfo, ok := info.(credentials.TLSInfo); !ok || tlsInfo.State.NegotiatedProtocol != wire.DialProtocol {
		conn.Close()
		return nil, errNotAccepted
	}
	conn = wire.CloseNotified(conn, sock)
	if _, err = wire.AwaitAccepted(ctx, conn, sock); err != nil {
		conn.Close()
		return nil, err
	}
	return &spare{conn: conn, sock: sock}, nil
}
