package kcpplugin

import (
	"context"
	"errors"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// directConn is a net.Conn over a dial connection (docs/protocol.md §3.6).
// Its dial goes as a conn's on a Dial stream does (establish.go): with its
// first Write, carrying that Write's first bytes as early data, or with its
// first Read or CloseWrite; DialService sends it at once unless
// Dialer.EarlyData lets the conn's first Read or Write meet the answer. The
// spare's goroutine reads the broker's answer (wire.Spares); after it,
// the conn reads and writes the TLS connection as it is.
type directConn struct {
	*spare
	remote net.Addr

	// sendMu guards target, and keeps the dial's write apart from Write's.
	sendMu sync.Mutex
	target *tunnelv1.Target // until the dial is sent (or abandoned)

	timeout time.Duration
	timer   *time.Timer // ends the dial when timeout passes unanswered
	outcome atomic.Int32
	// answered is closed once the broker answered or the dial failed;
	// err is the failure, set before.
	answered chan struct{}
	err      error
	readDL   *deadline // for a Read waiting for the answer
	// untrack, set by the Dialer, forgets the conn once it is closed.
	untrack func()

	// dlMu keeps the read deadline off the connection while the spare's
	// goroutine reads the answer, and gives it the deadline after.
	dlMu         sync.Mutex
	readDeadline time.Time
}

var _ net.Conn = (*directConn)(nil)

// newDirectConn takes spare s for a dial of target, which timeout bounds
// from now to the broker's answer.
func newDirectConn(s *wire.Spare[*spare, error], target *tunnelv1.Target, timeout time.Duration) *directConn {
	c := &directConn{spare: s.Conn(), remote: addr(target.Key()), target: target, timeout: timeout,
		answered: make(chan struct{}), readDL: newDeadline(nil)}
	c.timer = time.AfterFunc(timeout, c.timedOut)
	s.OnAnswer(c.answer)
	return c
}

// sendDial sends the dial, with up to wire.MaxEarlyData bytes of p as its
// early data and the rest of p after it, unless it has gone; it returns how
// much of p went. p's bytes are written as soon as the dial: the broker
// reads them once the tunnel is established.
func (c *directConn) sendDial(p []byte) (n int, sent bool, err error) {
	c.sendMu.Lock()
	defer c.sendMu.Unlock()
	if c.target == nil {
		return 0, false, nil
	}
	early := p[:min(len(p), wire.MaxEarlyData)]
	buf, err := wire.AppendDial(nil, c.target, early)
	c.target = nil
	if err != nil {
		return 0, true, err
	}
	if _, err := c.conn.Write(buf); err != nil {
		return 0, true, err
	}
	if rest := p[len(early):]; len(rest) > 0 {
		m, err := c.conn.Write(rest)
		return len(early) + m, true, err
	}
	return len(early), true, nil
}

// waitEstablished sends the dial and waits for its answer or for ctx; on
// an error the conn is closed.
func (c *directConn) waitEstablished(ctx context.Context) error {
	if _, _, err := c.sendDial(nil); err != nil {
		c.failed(err)
	}
	select {
	case <-c.answered:
	case <-ctx.Done():
		c.finish(dialFailed, status.FromContextError(ctx.Err()).Err())
	}
	if c.err != nil {
		c.Close()
		return c.err
	}
	return nil
}

// answer takes the broker's answer to the dial, read by the spare's
// goroutine: the tunnel, or its failure.
func (c *directConn) answer(err error) {
	if err != nil {
		if _, ok := status.FromError(err); !ok {
			err = c.lostBeforeAnswer(err)
		}
		c.finish(dialFailed, err)
		return
	}
	c.dlMu.Lock()
	defer c.dlMu.Unlock()
	if c.finish(dialEstablished, nil) {
		_ = c.conn.SetReadDeadline(c.readDeadline)
	}
}

// lostBeforeAnswer is what a connection that ended before the broker's
// answer means for the dial.
func (c *directConn) lostBeforeAnswer(err error) error {
	if errors.Is(err, net.ErrClosed) {
		return status.Error(codes.Canceled, "the connection was closed before the broker answered its dial")
	}
	return status.Errorf(codes.Unavailable, "the broker's dial connection ended before it answered the dial: %v", err)
}

// timedOut ends a dial still unanswered when its timeout passes.
func (c *directConn) timedOut() {
	if c.finish(dialTimedOut, status.Errorf(codes.DeadlineExceeded, "dial %s timed out after %v", c.remote, c.timeout)) {
		c.abort()
	}
}

// failed ends the dial with a failure to send it.
func (c *directConn) failed(err error) {
	if c.finish(dialFailed, c.lostBeforeAnswer(err)) {
		c.abort()
	}
}

// finish decides the dial's outcome, once; true for the call that did.
func (c *directConn) finish(outcome int32, err error) bool {
	if !c.outcome.CompareAndSwap(dialing, outcome) {
		return false
	}
	if outcome != dialTimedOut {
		// The timer's own goroutine may not read c.timer: it was set
		// after the timer started.
		c.timer.Stop()
	}
	c.err = err
	close(c.answered)
	return true
}

// awaitAnswer waits for the broker's answer, within the read deadline, and
// returns the dial's failure if it failed.
func (c *directConn) awaitAnswer() error {
	select {
	case <-c.answered:
		return c.err
	default:
	}
	select {
	case <-c.answered:
		return c.err
	case <-c.readDL.wait():
		return os.ErrDeadlineExceeded
	}
}

// Read sends the dial if no Write has, waits for its answer, and then
// reads the tunnel's bytes.
func (c *directConn) Read(p []byte) (int, error) {
	if _, _, err := c.sendDial(nil); err != nil {
		c.failed(err)
	}
	if err := c.awaitAnswer(); err != nil {
		return 0, err
	}
	return c.conn.Read(p)
}

// Write writes p to the tunnel, the dial first if it has not gone. A write
// that fails before the broker answered returns the dial's failure once
// the answer or the timeout says what it is.
func (c *directConn) Write(p []byte) (int, error) {
	if isClosed(c.answered) && c.err != nil {
		return 0, c.err
	}
	n, sent, err := c.sendDial(p)
	if !sent {
		n, err = c.conn.Write(p)
	}
	if err != nil && c.outcome.Load() != dialEstablished {
		c.failed(err)
		<-c.answered
		if c.err != nil {
			return n, c.err
		}
	}
	return n, err
}

// CloseWrite sends the dial if nothing has, then half-closes the tunnel:
// the target reads the end of its input.
func (c *directConn) CloseWrite() error {
	if _, _, err := c.sendDial(nil); err != nil {
		c.failed(err)
		return c.err
	}
	return c.conn.(interface{ CloseWrite() error }).CloseWrite()
}

// Close ends the tunnel: with a close_notify, which the broker takes as
// the end of this direction, and the close of the socket after it.
func (c *directConn) Close() error {
	if c.untrack != nil {
		c.untrack()
	}
	c.sendMu.Lock()
	unsent := c.target != nil
	c.target = nil
	c.sendMu.Unlock()
	if unsent {
		// The broker has read nothing: the connection just ends.
		c.finish(dialFailed, status.Error(codes.Canceled, "the connection was closed before its dial was sent"))
	}
	err := c.conn.Close()
	if errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}

func (c *directConn) LocalAddr() net.Addr  { return addr("kcp-tunnel-client") }
func (c *directConn) RemoteAddr() net.Addr { return c.remote }

func (c *directConn) SetDeadline(t time.Time) error {
	_ = c.SetReadDeadline(t)
	return c.SetWriteDeadline(t)
}

// SetReadDeadline bounds Read, the wait for the broker's answer included.
// The connection gets the deadline once the spare's goroutine has read the
// answer, so that it does not cut that read short.
func (c *directConn) SetReadDeadline(t time.Time) error {
	c.readDL.set(t)
	c.dlMu.Lock()
	defer c.dlMu.Unlock()
	c.readDeadline = t
	if c.outcome.Load() == dialEstablished {
		return c.conn.SetReadDeadline(t)
	}
	return nil
}

func (c *directConn) SetWriteDeadline(t time.Time) error { return c.conn.SetWriteDeadline(t) }
