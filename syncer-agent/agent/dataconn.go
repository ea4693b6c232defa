package agent

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// serve carries the dial order the broker sent on the idle spare taken
// (docs/protocol.md §3.5), in the spare's watching goroutine. It connects
// as for an order on the control stream, and answers on the connection: a
// failure leaves the connection idle, back in the pool; OK starts the
// tunnel, whose copier from the broker runs on in this goroutine, so that
// a message costs no hand-off between goroutines.
func (d *spareDialer) serve(pool *spares, taken *takenSpare, order *tunnelv1.DialOrder) {
	if why := d.admit(); why != "" {
		d.refuse(taken, why)
		return
	}
	defer d.run.tunnels.Done()
	dl := d.run.newDialed(order)
	if err := d.run.dialTarget(d.run.ctx, dl, order); err != nil {
		d.answerFailure(pool, taken, dl, err.status())
		return
	}
	s := taken.Conn()
	if err := wire.WriteAnswer(s.conn, nil); err != nil {
		// The broker takes a connection that ends before the answer for
		// the dial's failure; the target has had nothing yet.
		dl.target.Close()
		s.reset()
		dl.log.Info("could not answer the dial order", "leg", "data connection", "error", err)
		return
	}
	dl.log.Debug("tunnel open", "leg", "data connection", "target", dl.target.RemoteAddr().String())
	d.carry(pool, taken, dl)
}

// admit counts the tunnel of an order read on a spare with the agent's
// tunnels, which its drain waits for, or says why the agent refuses it:
// the session is over, and the pool takes back no spare, or the agent
// drains.
func (d *spareDialer) admit() (refused string) {
	if d.session.Err() != nil {
		return "the agent's registration with the broker has ended"
	}
	if !d.run.admit() {
		return shuttingDown
	}
	return ""
}

// refuse answers an order the agent does not carry with Unavailable, as a
// dial_failure would, and closes the connection.
func (d *spareDialer) refuse(taken *takenSpare, why string) {
	s := taken.Conn()
	if err := wire.WriteAnswer(s.conn, status.Error(codes.Unavailable, why)); err != nil {
		s.abort()
	}
	s.conn.Close()
}

// answerFailure answers the dial's failure, after which the connection is
// idle again and goes back to the pool; a connection that cannot carry
// the answer is closed.
func (d *spareDialer) answerFailure(pool *spares, taken *takenSpare, dl *dialed, failure error) {
	s := taken.Conn()
	if err := wire.WriteAnswer(s.conn, failure); err != nil {
		dl.log.Info("could not answer the dial order", "leg", "data connection", "error", err)
		s.reset()
		return
	}
	pool.Return(taken)
}

// carry runs the tunnel the agent answered OK until it has ended each
// way, counted as the agent's tunnels are, then gives the connection back
// to the pool to carry the next order (§3.7), or resets it if it cannot.
func (d *spareDialer) carry(pool *spares, taken *takenSpare, dl *dialed) {
	defer dl.target.Close()
	tunnelsOpen.Inc()
	defer tunnelsOpen.Dec()
	tunnelsOpened.WithLabelValues(legDataConnection).Inc()
	s := taken.Conn()
	t := &dataTunnel{spare: s, leg: wire.NewLeg(s.conn), target: dl.target,
		stall: cmp.Or(d.run.StalledWriteTimeout, DefaultStalledWriteTimeout), downDone: make(chan struct{})}
	idle := t.run(d.run.ctx, dl.early)
	if idle {
		pool.Return(taken)
	} else {
		s.reset()
	}
	t.report(dl, idle)
}

// report logs how the tunnel ended: idle says whether its data
// connection went back to the pool. The broker claimed the dial with the
// agent's OK: nothing goes on the control stream.
func (t *dataTunnel) report(d *dialed, idle bool) {
	t.mu.Lock()
	err := t.cause
	t.mu.Unlock()
	if err == nil {
		if !idle {
			d.log.Info("the tunnel's end exchange did not complete: its data connection is closed", "leg", "data connection")
		}
		return
	}
	d.log.Info("tunnel ended", "leg", "data connection", "error", err, "connection_reused", idle)
}

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

// dataTunnel is one tunnel on a data connection, from the agent's OK
// answer on. Each direction is one goroutine that reads from one side and
// writes to the other: the spare's, which read the order, copies the
// broker's bytes to the target, and one of the tunnel's own copies the
// target's bytes to the broker. A message costs no hand-off between
// goroutines. Both go through leg, the tunnel's frames (§3.7).
type dataTunnel struct {
	spare  *spare
	leg    *wire.Leg
	target *net.TCPConn
	stall  time.Duration // the longest a write to the target may take
	// downDone closes once the copier from the broker has returned.
	downDone chan struct{}

	mu sync.Mutex
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
// goes to the target first: after the answer, so that a failed dial has
// sent none, and before anything the broker sends, which this goroutine
// copies next.
func (t *dataTunnel) run(ctx context.Context, early []byte) (idle bool) {
	stop := context.AfterFunc(ctx, func() { t.abort(errors.New("the agent stopped")) })
	if len(early) > 0 {
		if _, err := t.target.Write(early); err != nil {
			t.targetFailed(targetError{"writing early data to target", err})
		}
	}
	finished := make(chan bool, 1)
	go func() { finished <- t.upThenFinish() }()
	t.down()
	idle = <-finished
	_ = t.target.Close()
	// Once the agent has begun to stop, the connection may be reset at
	// any moment: it must not go back to the pool.
	return stop() && idle
}

// upThenFinish copies the target's direction (up), then completes the end
// exchange (finish) and says whether the connection is idle again. A
// target that half-closed cleanly leaves the broker's direction running
// until the broker ends the tunnel; a failure needs no wait, as finish
// frees the copier from the broker.
func (t *dataTunnel) upThenFinish() bool {
	if t.up() {
		<-t.downDone
	}
	return t.finish()
}

// up is the copier from the target: it copies the target's bytes to the
// broker, then the target's end as a close_write, and says whether it got
// that far.
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

// down is the copier from the broker: it copies the broker's bytes to the
// target, then the broker's close_write as the target's half-close, until
// the broker's end.
func (t *dataTunnel) down() {
	defer close(t.downDone)
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
// then.
func (t *dataTunnel) targetFailed(err targetError) {
	t.mu.Lock()
	ending := t.ending
	if !ending {
		t.ending, t.cause = true, err
	}
	t.mu.Unlock()
	if ending {
		// The tunnel's end closed the target: nothing failed.
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

// finish completes the end exchange, and says whether the connection is
// idle again: not once the tunnel aborted. It sends the agent's end unless
// sent, and reads what the broker sends until its end, each for at most
// wire.EndTimeout; a read of the copier from the broker under way returns.
func (t *dataTunnel) finish() bool {
	t.mu.Lock()
	aborted := t.aborted
	t.mu.Unlock()
	if aborted || !t.leg.Finish() {
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
