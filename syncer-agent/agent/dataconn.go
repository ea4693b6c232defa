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

// openData carries a dial on the data connection of the spare taken from
// pool (docs/protocol.md §3.5): it sends the open and returns the rest of
// the tunnel's life, as open does, or reports why not and returns nil.
// Once the tunnel has ended each way, the connection goes back to pool to
// carry the next dial (§3.7), or is reset if it cannot.
func openData(ctx context.Context, pool *spares, taken *takenSpare, d *dialed, stall time.Duration) (run func()) {
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
		tunnelsOpen.Inc()
		defer tunnelsOpen.Dec()
		tunnelsOpened.WithLabelValues(legDataConnection).Inc()
		t := &dataTunnel{spare: s, taken: taken, leg: wire.NewLeg(s.conn), target: d.target, stall: stall,
			answered: make(chan struct{}), downDone: make(chan struct{})}
		idle := t.run(ctx, d.early)
		if idle {
			pool.Return(taken)
		} else {
			s.abort()
			s.conn.Close()
		}
		t.report(d, idle)
	}
}

// report logs how the tunnel ended, and fails the dial if the broker may
// not have taken it: idle says whether its data connection went back to
// the pool.
func (t *dataTunnel) report(d *dialed, idle bool) {
	t.mu.Lock()
	err, accepted := t.cause, t.accepted
	t.mu.Unlock()
	if err == nil {
		if !idle {
			d.log.Info("the tunnel's end exchange did not complete: its data connection is closed", "leg", "data connection")
		}
		return
	}
	d.log.Info("tunnel ended", "leg", "data connection", "error", err, "connection_reused", idle)
	var refused refusal
	var unanswered noAnswer
	switch {
	case errors.As(err, &refused):
		st := status.Convert(refused.err)
		d.report(st.Code(), "the broker refused the tunnel: "+st.Message(), true)
	case errors.As(err, &unanswered):
		d.report(codes.Unavailable, "the broker's data connection ended before it answered the open", true)
	case !accepted:
		// As on a Tunnel stream: the broker may not have read the
		// open, and the dial would wait there for its timeout.
		d.report(codes.Unavailable, "the tunnel failed as it opened: "+reason(err), true)
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

// targetError is a failure of the target connection: op says what the
// agent was doing.
type targetError struct {
	op  string // "reading from target", ...
	err error
}

func (e targetError) Error() string { return e.op + ": " + e.err.Error() }
func (e targetError) Unwrap() error { return e.err }

// message is why, for the agent's end: the broker passes it on to the
// caller, so it is in words, without the addresses of Go's errors.
func (e targetError) message() string {
	return "the agent's connection to the target failed, " + e.op + ": " + reason(e.err)
}

// dataTunnel is one tunnel on a data connection. Each direction is one
// goroutine that reads from one side and writes to the other: the
// tunnel's own copies the target's bytes to the broker, and the spare's,
// which was waiting for the broker's answer to the open, copies the
// broker's bytes to the target. A message costs no hand-off between
// goroutines. Both go through leg, the tunnel's frames (§3.7): the
// target's bytes from the open on, the broker's once it has answered.
type dataTunnel struct {
	spare  *spare
	taken  *takenSpare // to hand its answer to down
	leg    *wire.Leg
	target *net.TCPConn
	stall  time.Duration // the longest a write to the target may take
	// answered closes once the copier from the broker has read the answer
	// to the open, or failed to; downDone once it has returned.
	answered, downDone chan struct{}

	mu sync.Mutex
	// accepted says that the broker answered the open with OK.
	accepted bool
	// ending says that the tunnel is over for the target: the broker
	// ended it, the target failed, or the tunnel aborted. What fails
	// after it (a read of the target closed because of it) is no
	// failure of its own.
	ending bool
	// aborted says that both connections were reset.
	aborted bool
	cause   error // the first failure
}

// run carries the tunnel until it has ended each way, or failed, or ctx
// ends, and says whether its data connection is idle again. Both copiers
// have stopped and the target is closed by then, so that nothing of this
// tunnel touches the connection once it carries the next. The early data
// goes to the target first: after the open, and before anything the
// broker sends, which its copier writes only once handed the tunnel.
func (t *dataTunnel) run(ctx context.Context, early []byte) (idle bool) {
	stop := context.AfterFunc(ctx, func() { t.abort(errors.New("the agent stopped")) })
	if len(early) > 0 {
		if _, err := t.target.Write(early); err != nil {
			t.targetFailed(targetError{"writing early data to target", err})
		}
	}
	t.taken.OnAnswer(t.down)
	if t.up() {
		// The target's direction ended cleanly; the broker's runs on
		// until the broker ends the tunnel.
		<-t.downDone
	}
	<-t.answered
	idle = t.finish()
	<-t.downDone
	_ = t.target.Close()
	// Once the agent has begun to stop, the connection may be reset at
	// any moment: it must not go back to the pool.
	return stop() && idle
}

// up is the copier from the target: it copies the target's bytes to the
// broker, then the target's end as a close_write, and says whether it got
// that far. The target's bytes may follow the open before the broker's
// answer: the leg writes them in frames, as the broker reads them once it
// has answered.
func (t *dataTunnel) up() (halfClosed bool) {
	readErr, writeErr := copyHalf(t.leg, t.target)
	switch {
	case writeErr != nil:
		t.connFailed(fmt.Errorf("writing to the broker: %w", writeErr))
	case !errors.Is(readErr, io.EOF):
		t.targetFailed(targetError{"reading from target", readErr})
	default:
		if err := t.leg.CloseWrite(); err != nil {
			t.connFailed(fmt.Errorf("half-closing to the broker: %w", err))
			return false
		}
		return true
	}
	return false
}

// down is the copier from the broker, in the spare's goroutine: answer is
// what the broker said to the open. It copies the broker's bytes to the
// target, then the broker's close_write as the target's half-close, until
// the broker's end.
func (t *dataTunnel) down(answer error) {
	defer close(t.downDone)
	if !t.accept(answer) {
		return
	}
	readErr, writeErr := copyHalf(stallBounded{t.target, t.stall}, t.leg)
	if writeErr != nil {
		t.targetFailed(targetError{"writing to target", writeErr})
		return
	}
	if ended, _ := t.leg.PeerEnded(); !ended && errors.Is(readErr, io.EOF) {
		// The broker's close_write.
		if err := t.target.CloseWrite(); err != nil {
			t.targetFailed(targetError{"half-closing target", err})
			return
		}
		readErr = t.leg.AwaitEnd()
	}
	if ended, end := t.leg.PeerEnded(); ended {
		t.brokerEnded(end)
		return
	}
	t.connFailed(fmt.Errorf("reading from the broker: %w", readErr))
}

// accept takes the broker's answer to the open, and says whether the
// tunnel goes on: a refusal, or a connection that ended first, fails it.
func (t *dataTunnel) accept(answer error) bool {
	defer close(t.answered)
	switch {
	case answer == nil:
		t.mu.Lock()
		defer t.mu.Unlock()
		t.accepted = true
		return !t.aborted
	case isStatus(answer):
		t.abort(refusal{answer})
	default:
		t.abort(noAnswer{answer})
	}
	return false
}

// isStatus says whether err is the broker's refusal itself, which
// wire.ReadOpenResult returns as a bare status; the connection's errors it
// wraps.
func isStatus(err error) bool {
	_, ok := err.(interface{ GRPCStatus() *status.Status })
	return ok
}

// brokerEnded ends the target's side once the broker has ended the
// tunnel: a close after an OK end, which comes once both directions have
// half-closed, and a reset after a failure, as on a Tunnel stream. The
// copier from the target then stops, and finish sends the agent's end.
func (t *dataTunnel) brokerEnded(end error) {
	t.mu.Lock()
	ending := t.ending
	t.ending = true
	if !ending && end != nil {
		t.cause = fmt.Errorf("the broker ended the tunnel: %w", end)
	}
	t.mu.Unlock()
	if ending {
		return
	}
	if end != nil {
		_ = t.target.SetLinger(0)
	}
	_ = t.target.Close()
}

// targetFailed ends the tunnel for a target connection that failed: the
// broker gets the agent's end, Unavailable and why, and the target a
// reset. The copier from the broker stops at its next write to the
// target, or at the broker's end; finish reads what the broker sends until
// then. Before the broker's OK there is no tunnel to end: the tunnel
// aborts, as it always has.
func (t *dataTunnel) targetFailed(err targetError) {
	t.mu.Lock()
	ending, accepted := t.ending, t.accepted
	if !ending && accepted {
		t.ending, t.cause = true, err
	}
	t.mu.Unlock()
	switch {
	case ending:
		// The tunnel's end closed the target: nothing failed.
		return
	case !accepted:
		t.abort(err)
		return
	}
	if werr := t.leg.End(status.Error(codes.Unavailable, err.message())); werr != nil {
		t.abort(fmt.Errorf("sending the agent's end: %w", werr))
	}
	_ = t.target.SetLinger(0)
	_ = t.target.Close()
}

// connFailed is a failure of the data connection, or a frame the protocol
// does not allow: the tunnel aborts. Once the tunnel is ending, finish
// finds out whether the connection survived instead.
func (t *dataTunnel) connFailed(err error) {
	t.mu.Lock()
	ending := t.ending
	t.mu.Unlock()
	if !ending {
		t.abort(err)
	}
}

// abort resets both connections, which ends both copiers, and keeps the
// first cause.
func (t *dataTunnel) abort(cause error) {
	t.mu.Lock()
	first := !t.aborted
	t.aborted, t.ending = true, true
	if t.cause == nil {
		t.cause = cause
	}
	t.mu.Unlock()
	if first {
		t.spare.abort()
		_ = t.target.SetLinger(0)
		_ = t.target.Close()
	}
}

// finish completes the end exchange once the broker has answered the
// open, and says whether the connection is idle again: not after a
// refusal, nor once the tunnel aborted. It sends the agent's end unless
// sent, and reads what the broker sends until its end, each for at most
// wire.EndTimeout; a read of the copier from the broker under way returns.
func (t *dataTunnel) finish() bool {
	t.mu.Lock()
	over := t.aborted || !t.accepted
	t.mu.Unlock()
	if over || !t.leg.Finish() {
		return false
	}
	// An abort during Finish reset the connection.
	t.mu.Lock()
	defer t.mu.Unlock()
	return !t.aborted
}

// DefaultStalledWriteTimeout is the broker's default --idle-timeout: by
// then a tunnel whose target takes nothing has carried nothing, and the
// broker has ended it.
const DefaultStalledWriteTimeout = 10 * time.Minute

// stallBounded is a target whose every Write must make progress within
// stall. A target that stops reading blocks the copier from the broker in
// its Write, where it reads neither the broker's end nor a reset: without
// a bound the tunnel's goroutines and sockets would stay until the target
// read again. One deadline per write costs a timer update, not a
// goroutine.
type stallBounded struct {
	*net.TCPConn
	stall time.Duration
}

func (s stallBounded) Write(p []byte) (int, error) {
	_ = s.SetWriteDeadline(time.Now().Add(s.stall))
	return s.TCPConn.Write(p)
}

// copyHalf copies src's bytes to dst as they arrive, until a read of src
// or a write of dst fails: it returns the read's error (io.EOF for src's
// clean end) or the write's. It reads into a wire.ReadBuffer, so that a
// direction that waits holds 2 KiB, not a frame's 32.
func copyHalf(dst io.Writer, src io.Reader) (readErr, writeErr error) {
	var buf wire.ReadBuffer
	defer buf.Release()
	for {
		b, err := buf.Read(src)
		if len(b) > 0 {
			if _, err := dst.Write(b); err != nil {
				return nil, err
			}
		}
		if err != nil {
			return err, nil
		}
	}
}
