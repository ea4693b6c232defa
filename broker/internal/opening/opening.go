// Package opening bounds what a stream costs the broker before its first
// message: the first message must arrive within a deadline, and a peer may
// have only so many streams waiting for theirs at once, all peers together
// only so many more. Past either limit a new stream gets ResourceExhausted
// at once.
//
// Why: until a message is whole, gRPC holds what has arrived of it, up to
// the server's largest message, and every HTTP/2 DATA frame of it as a
// buffer of its own. The broker closes a connection whose peer sends data
// in frames of less than 8 bytes or padded (package fragments); in 8-byte
// frames an unfinished message of 32 KiB still costs about 0.4 MiB
// (measured with tunnelbench -phases hostile -hostile-frame 8). A stream
// that never finishes its first message would hold that for as long as the
// peer keeps the stream open. With these bounds, what all such streams hold
// is at most MaxTotal x that, and for one peer MaxPerPeer x that, each for
// at most Timeout.
//
// A streaming RPC counts once it has waited Patience for its first message,
// until that message arrives; the stream is ended with DeadlineExceeded once
// Timeout passes. A well-behaved peer sends the first message with the
// stream's headers, but in a burst of new streams gRPC reads many headers
// before their messages, so that counting from the handler's start would
// refuse a burst of ordinary dials. What streams younger than Patience hold
// is bounded by what the broker can read in that time. gRPC reads a unary
// RPC's request before any interceptor runs, so a unary RPC counts from the
// moment its stream opens (gRPC's tap), and the whole call is bounded by
// Timeout: the broker's unary RPCs (health, ListAgents) answer at once.
package opening

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"
	"k8s.io/utils/clock"

	"github.com/kcp-dev/tunnel-broker/broker/internal/quota"
	"github.com/kcp-dev/tunnel-broker/broker/internal/receive"
	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
)

// Defaults of Config.
const (
	// DefaultPatience is far longer than a burst of ordinary streams waits
	// for gRPC to read their first messages, and short enough that what
	// streams hold before they count stays small.
	DefaultPatience = time.Second
	// DefaultMaxPerPeer and DefaultMaxTotal bound the streams that wait for
	// their first message, per peer SPIFFE ID and in total. A well-behaved
	// peer sends its first message with the stream's headers, so its
	// streams wait microseconds; 32 unfinished messages of the largest size
	// (32 KiB), in 8-byte frames (about 0.4 MiB each; smaller or padded
	// frames close the connection, package fragments), hold about 13 MiB,
	// and 128 about 52 MiB.
	DefaultMaxPerPeer = 32
	DefaultMaxTotal   = 128
)

// Config is what the guard needs. As in every Config of the broker, zero
// means the default, and a negative limit means none.
type Config struct {
	// Timeout is how long a stream may take to send its first message: the
	// broker's --dial-timeout.
	Timeout time.Duration
	// Patience is how long a stream may wait for its first message before
	// it counts against the limits; zero: DefaultPatience.
	Patience time.Duration
	// MaxPerPeer and MaxTotal bound the streams waiting for their first
	// message, per peer SPIFFE ID and in total; zero: DefaultMaxPerPeer and
	// DefaultMaxTotal.
	MaxPerPeer, MaxTotal int64
	// First names the first message of methods by full name, for the status
	// of a stream that does not send it in time ("target" for Dial).
	First map[string]string
	// Clock times the patience and the timeout; nil: the real clock.
	Clock clock.WithDelayedExecution
	Log   *slog.Logger
}

// Guard enforces the bounds on one gRPC server. Install ServerOptions when
// building the server, and call Methods once its services are registered.
type Guard struct {
	cfg   Config
	quota quota.Quota

	unary atomic.Pointer[map[string]bool]
}

// New is a guard with cfg, its defaults resolved.
func New(cfg Config) *Guard {
	cfg.Patience = cmp.Or(max(cfg.Patience, 0), DefaultPatience)
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	cfg.Log = cmp.Or(cfg.Log, slog.Default())
	return &Guard{
		cfg:   cfg,
		quota: quota.Quota{PerID: cmp.Or(cfg.MaxPerPeer, DefaultMaxPerPeer), Total: cmp.Or(cfg.MaxTotal, DefaultMaxTotal)},
	}
}

// ServerOptions install the guard. Install them after the authorization
// interceptors: a peer refused by the policy is refused before it is
// counted.
func (g *Guard) ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.InTapHandle(g.tap),
		grpc.ChainUnaryInterceptor(g.unaryArrived),
		grpc.ChainStreamInterceptor(g.stream),
	}
}

// Methods tells the guard which of srv's methods are unary. Call it after
// registering every service, before serving.
func (g *Guard) Methods(srv *grpc.Server) {
	unary := map[string]bool{}
	for name, info := range srv.GetServiceInfo() {
		for _, m := range info.Methods {
			if !m.IsClientStream && !m.IsServerStream {
				unary["/"+name+"/"+m.Name] = true
			}
		}
	}
	g.unary.Store(&unary)
}

func (g *Guard) isUnary(method string) bool {
	m := g.unary.Load()
	return m != nil && (*m)[method]
}

// releaseKey carries a unary call's release to its interceptor.
type releaseKey struct{}

// tap runs as a stream opens, before gRPC reads anything of it.
func (g *Guard) tap(ctx context.Context, info *tap.Info) (context.Context, error) {
	if !g.isUnary(info.FullMethodName) {
		return ctx, nil
	}
	id, _ := identity.PeerID(ctx)
	release, err := g.take(id)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, g.cfg.Timeout)
	// Ends with the stream, or at the deadline: either way it no longer
	// waits for its request.
	context.AfterFunc(ctx, func() {
		release()
		cancel()
	})
	return context.WithValue(ctx, releaseKey{}, release), nil
}

// unaryArrived runs once gRPC has read a unary call's request.
func (g *Guard) unaryArrived(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if release, ok := ctx.Value(releaseKey{}).(func()); ok {
		release()
	}
	return handler(ctx, req)
}

// stream runs the handler of a stream that must send its first message in
// time. Its own frame stays small, and the watch is set up in a call of its
// own, because this frame stays on the stack of every tunnel's handler for
// the tunnel's life (docs/perf-history.md, idle tunnels' stacks).
func (g *Guard) stream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	w := g.watch(ss, info.FullMethod)
	defer w.done()
	return handler(srv, w)
}

// watch starts waiting for ss's first message. It is never inlined:
// inlined, its locals would be back in stream's frame.
//
//go:noinline
func (g *Guard) watch(ss grpc.ServerStream, method string) *firstMessage {
	id, _ := identity.PeerID(ss.Context())
	w := &firstMessage{ServerStream: ss, guard: g, peer: id, method: method, ended: make(chan struct{})}
	w.mu.Lock()
	w.timer = g.cfg.Clock.AfterFunc(min(g.cfg.Patience, g.cfg.Timeout), w.count)
	w.mu.Unlock()
	return w
}

// take counts one more stream waiting for its first message, unless a limit
// is reached.
func (g *Guard) take(id spiffeid.ID) (release func(), err error) {
	release, over := g.quota.Take(id)
	switch over {
	case quota.OverPerID:
		metrics.LimitsHit.WithLabelValues("opening_streams_per_peer").Inc()
		return nil, status.Errorf(codes.ResourceExhausted, "%s has %d streams open that have not sent their first message, the most a peer may", id, g.quota.PerID)
	case quota.OverTotal:
		metrics.LimitsHit.WithLabelValues("opening_streams").Inc()
		return nil, status.Errorf(codes.ResourceExhausted, "the broker has %d streams open that have not sent their first message, the most it holds: try again shortly", g.quota.Total)
	}
	return release, nil
}

// The states of a stream's first message.
const (
	waiting int32 = iota
	arrived
	ended // by the guard, with a status
)

// firstMessage is a server stream whose first RecvMsg ends the wait. Its
// timer counts it against the quota once it has waited the guard's
// patience, then ends it at the guard's timeout.
type firstMessage struct {
	grpc.ServerStream
	guard  *Guard
	peer   spiffeid.ID
	method string

	state atomic.Int32 // read without mu once the first message arrived

	mu      sync.Mutex
	timer   clock.Timer
	release func() // set while the stream counts against the quota
	status  error  // what the guard ended the stream with, before ended closes
	ended   chan struct{}
}

// RecvMsg receives the first message in a goroutine of its own
// (receive.Before), so that the guard can end a stream whose first message
// does not come: the handler, freed, returns the guard's status. Later
// messages are received as they are.
func (w *firstMessage) RecvMsg(m any) error {
	if w.state.Load() == arrived {
		return w.ServerStream.RecvMsg(m)
	}
	stopped, err := receive.Before(w.ended, func() error { return w.ServerStream.RecvMsg(m) })
	if stopped {
		return w.status
	}
	w.mu.Lock()
	if w.state.Load() == ended {
		// The guard ended the stream first, whatever this Recv got.
		defer w.mu.Unlock()
		return w.status
	}
	w.state.Store(arrived)
	w.timer.Stop()
	release := w.release
	w.release = nil
	w.mu.Unlock()
	if release != nil {
		release()
	}
	return err
}

// count runs once the stream has waited the guard's patience: it counts the
// stream against the quota, or ends it if a limit is reached, and sets the
// timer for the rest of the timeout.
func (w *firstMessage) count() {
	g := w.guard
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.state.Load() != waiting {
		return
	}
	release, err := g.take(w.peer)
	if err != nil {
		w.end(err)
		return
	}
	w.release = release
	w.timer = g.cfg.Clock.AfterFunc(max(g.cfg.Timeout-g.cfg.Patience, 0), w.expire)
}

// expire ends a stream whose first message did not come within the timeout.
func (w *firstMessage) expire() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.state.Load() != waiting {
		return
	}
	metrics.LimitsHit.WithLabelValues("first_message_timeout").Inc()
	w.guard.cfg.Log.Info("stream ended: no first message in time", "peer", w.peer.String(), "method", w.method, "timeout", w.guard.cfg.Timeout)
	w.end(w.late())
}

// late is the status of a stream whose first message did not come in time.
func (w *firstMessage) late() error {
	what := cmp.Or(w.guard.cfg.First[w.method], "request")
	return status.Error(codes.DeadlineExceeded,
		fmt.Sprintf("no %s within %v: the first message of this stream must be its %s", what, w.guard.cfg.Timeout, what))
}

// end ends the stream with err, which its handler, waiting for its first
// message, returns; and stops counting it. w.mu is held.
func (w *firstMessage) end(err error) {
	w.state.Store(ended)
	w.status = err
	if w.release != nil {
		w.release()
		w.release = nil
	}
	close(w.ended)
}

// done runs when the handler returns: the stream no longer counts.
func (w *firstMessage) done() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.timer.Stop()
	if w.release != nil {
		w.release()
		w.release = nil
	}
}
