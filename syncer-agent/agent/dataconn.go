package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// openData carries a dial on the data connection of the spare taken
// (docs/protocol.md §3.5): it sends the open and returns the rest of the
// tunnel's life, as open does, or reports why not and returns nil.
func openData(ctx context.Context, taken *takenSpare, d *dialed, stall time.Duration) (run func()) {
	s := taken.Conn()
	if err := wire.WriteOpen(s.conn, d.id); err != nil {
		// The spare's goroutine waits for a tunnel: there is none.
		taken.OnAnswer(nil)
		s.abort()
		s.conn.Close()
		d.target.Close()
		d.log.Info("could not open tunnel", "leg", "data connection", "error", err)
		d.report(codes.Unavailable, "the agent could not open a tunnel to the broker", false)
		return nil
	}
	d.log.Debug("tunnel open", "leg", "data connection", "target", d.target.RemoteAddr().String())
	return func() {
		defer d.target.Close()
		defer s.conn.Close()
		tunnelsOpen.Inc()
		defer tunnelsOpen.Dec()
		tunnelsOpened.WithLabelValues(legDataConnection).Inc()
		t := &dataTunnel{spare: s, taken: taken, target: d.target, stall: stall, downDone: make(chan struct{})}
		err := t.run(ctx, d.early)
		if err == nil {
			return
		}
		d.log.Info("tunnel ended", "leg", "data connection", "error", err)
		var refused refusal
		var unanswered noAnswer
		switch {
		case errors.As(err, &refused):
			st := status.Convert(refused.err)
			d.report(st.Code(), "the broker refused the tunnel: "+st.Message(), true)
		case errors.As(err, &unanswered):
			d.report(codes.Unavailable, "the broker's data connection ended before it answered the open", true)
		case !t.answered:
			// As on a Tunnel stream: the broker may not have read the
			// open, and the dial would wait there for its timeout.
			d.report(codes.Unavailable, "the tunnel failed as it opened: "+reason(err), true)
		}
	}
}

// refusal is the broker's answer to an open that refused it: a status.
type refusal struct{ err error }

func (r refusal) Error() string { return "the broker refused the open: " + r.err.Error() }

// noAnswer is a data connection that failed before the broker answered
// the open.
type noAnswer struct{ err error }

func (n noAnswer) Error() string { return n.err.Error() }
func (n noAnswer) Unwrap() error { return n.err }

// dataTunnel is one tunnel on a data connection. Each direction is one
// goroutine that reads from one side and writes to the other: the
// tunnel's own copies the target's bytes to the broker, and the spare's,
// which was waiting for the broker's answer to the open, copies the
// broker's bytes to the target. A message costs no hand-off between
// goroutines.
type dataTunnel struct {
	spare  *spare
	taken  *takenSpare // to hand its answer to down
	target *net.TCPConn
	stall  time.Duration // the longest a write to the target may take
	// downDone closes when the copier from the broker has returned;
	// answered, which it sets, says that the broker accepted the open.
	downDone chan struct{}
	answered bool

	mu    sync.Mutex
	cause error // the first failure, which aborted the tunnel
}

// run carries the tunnel until both directions are closed, or either
// fails, or ctx ends; it returns the first failure. The early data goes
// to the target first: after the open, and before anything the broker
// sends, which its copier writes only once handed the tunnel.
func (t *dataTunnel) run(ctx context.Context, early []byte) error {
	stop := context.AfterFunc(ctx, func() { t.abort(errors.New("the agent stopped")) })
	defer stop()
	if len(early) > 0 {
		if _, err := t.target.Write(early); err != nil {
			t.abort(fmt.Errorf("writing early data to target: %w", err))
		}
	}
	t.taken.OnAnswer(t.down)
	if err := copyHalf(t.spare.conn, t.target, "target", "the broker"); err != nil {
		t.abort(err)
	}
	<-t.downDone
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.cause
}

// down is the copier from the broker, in the spare's goroutine: answer is
// what the broker said to the open.
func (t *dataTunnel) down(answer error) {
	defer close(t.downDone)
	var err error
	switch {
	case answer == nil:
		t.answered = true
		err = copyHalf(stallBounded{t.target, t.stall}, t.spare.conn, "the broker", "target")
	case isStatus(answer):
		err = refusal{answer}
	default:
		err = noAnswer{answer}
	}
	if err != nil {
		t.abort(err)
	}
}

// isStatus says whether err is the broker's refusal itself, which
// wire.ReadOpenResult returns as a bare status; the connection's errors it
// wraps.
func isStatus(err error) bool {
	_, ok := err.(interface{ GRPCStatus() *status.Status })
	return ok
}

// abort resets both connections, which ends both copiers, and keeps the
// first cause.
func (t *dataTunnel) abort(cause error) {
	t.mu.Lock()
	first := t.cause == nil
	if first {
		t.cause = cause
	}
	t.mu.Unlock()
	if first {
		t.spare.abort()
		_ = t.target.SetLinger(0)
		_ = t.target.Close()
	}
}

// DefaultStalledWriteTimeout is the broker's default --idle-timeout: by
// then a tunnel whose target takes nothing has carried nothing, and the
// broker has ended it.
const DefaultStalledWriteTimeout = 10 * time.Minute

// stallBounded is a target whose every Write must make progress within
// stall. A target that stops reading blocks the copier from the broker in
// its Write, and once the broker ends the tunnel nothing reads the data
// connection's reset: without a bound the tunnel's goroutines and sockets
// would stay until the target read again. One deadline per write costs a
// timer update, not a goroutine.
type stallBounded struct {
	*net.TCPConn
	stall time.Duration
}

func (s stallBounded) Write(p []byte) (int, error) {
	_ = s.SetWriteDeadline(time.Now().Add(s.stall))
	return s.TCPConn.Write(p)
}

// halfCloser is a connection whose sending direction closes alone: TCP's
// FIN, TLS's close_notify.
type halfCloser interface {
	io.Writer
	CloseWrite() error
}

// copyHalf copies one direction: src's bytes to dst as they arrive, then
// src's clean end as dst's half-close. It reads into a wire.ReadBuffer, so
// that a direction that waits holds 2 KiB, not a frame's 32. Its errors
// name the side that failed: from is src's name, to dst's.
func copyHalf(dst halfCloser, src io.Reader, from, to string) error {
	var buf wire.ReadBuffer
	defer buf.Release()
	for {
		b, err := buf.Read(src)
		if len(b) > 0 {
			if _, err := dst.Write(b); err != nil {
				return fmt.Errorf("writing to %s: %w", to, err)
			}
		}
		if errors.Is(err, io.EOF) {
			if err := dst.CloseWrite(); err != nil {
				return fmt.Errorf("half-closing %s: %w", to, err)
			}
			return nil
		}
		if err != nil {
			return fmt.Errorf("reading from %s: %w", from, err)
		}
	}
}
