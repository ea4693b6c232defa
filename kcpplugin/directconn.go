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
// spare's goroutine reads the broker's answer (wire.Spares). The tunnel
// goes in frames (§3.7), through a wire.Leg: what the conn writes after
// the dial, and what it reads after the answer. Once each side has sent
// its end, the connection goes back to the pool for the next dial
// (directend.go).
type directConn struct {
	*spare
	remote net.Addr
	// taken is the spare as the pool handed it out, for Spares.Return;
	// pool and live are the Dialer's.
	taken *wire.Spare[*spare, error]
	pool  *spares
	live  *liveConns
	leg   *wire.Leg

	// sendMu guards target, and keeps the dial's write apart from Write's.
	sendMu sync.Mutex
	target *tunnelv1.Target // until the dial is sent (or abandoned)

	// writeMu is held by Write and CloseWrite, so that Close can tell that
	// one is blocked; writeClosed is under it.
	writeMu     sync.Mutex
	writeClosed bool

	timeout time.Duration
	timer   *time.Timer // ends the dial when timeout passes unanswered
	outcome atomic.Int32
	// answered is closed once the broker answered or the dial failed;
	// err is the failure, set before.
	answered chan struct{}
	err      error
	readDL   *deadline // for a Read waiting for the answer

	// mu guards what follows, and keeps the connection's deadlines the
	// user's only while the tunnel has the connection: the spare's
	// goroutine reads the answer without them, and the end exchange, and
	// the next tunnel, have their own.
	mu           sync.Mutex
	readDeadline time.Time
	tunnelEnding
}

var _ net.Conn = (*directConn)(nil)

// newDirectConn takes spare s of pool for a dial of target, which timeout
// bounds from now to the broker's answer, tracked by live.
func newDirectConn(s *wire.Spare[*spare, error], target *tunnelv1.Target, timeout time.Duration, pool *spares, live *liveConns) *directConn {
	sp := s.Conn()
	c := &directConn{spare: sp, remote: addr(target.Key()), taken: s, pool: pool, live: live,
		// Its reads wait for the answer, but what follows the dial is
		// the tunnel's first frames.
		leg:    wire.NewLeg(sp.conn),
		target: target, timeout: timeout, answered: make(chan struct{}), readDL: newDeadline(nil)}
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
		m, err := c.leg.Write(rest)
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
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.finish(dialEstablished, nil) {
		_ = c.conn.SetReadDeadline(c.readDeadline)
	}
}

// lostBeforeAnswer is what a connection that ended before the broker's
// answer means for the dial.
func (c *directConn) lostBeforeAnswer(err error) error {
	if errors.Is(err, net.ErrClosed) {
		return errClosedBeforeAnswer
	}
	return status.Errorf(codes.Unavailable, "the broker's dial connection ended before it answered the dial: %v", err)
}

// errClosedBeforeAnswer is the dial's failure when the conn is closed
// after its dial went and before the broker's answer came.
var errClosedBeforeAnswer = status.Error(codes.Canceled, "the connection was closed before the broker answered its dial")

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
// reads the tunnel's bytes: io.EOF once the broker half-closed or ended
// the tunnel with OK, the status it ended the tunnel with otherwise.
func (c *directConn) Read(p []byte) (int, error) {
	if _, _, err := c.sendDial(nil); err != nil {
		c.failed(err)
	}
	if err := c.awaitAnswer(); err != nil {
		return 0, err
	}
	if err := c.readDone(); err != nil {
		return 0, err
	}
	n, err := c.leg.Read(p)
	if err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
		err = c.readEnded(err)
	}
	return n, err
}

// Write writes p to the tunnel, the dial first if it has not gone. A write
// that fails before the broker answered returns the dial's failure once
// the answer or the timeout says what it is.
func (c *directConn) Write(p []byte) (int, error) {
	if isClosed(c.answered) && c.err != nil {
		return 0, c.err
	}
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	if err := c.writable(); err != nil {
		return 0, err
	}
	n, sent, err := c.sendDial(p)
	if !sent {
		n, err = c.leg.Write(p)
	}
	if err != nil {
		err = c.writeFailed(err)
	}
	return n, err
}

// writable says why the conn may not write now, if it may not. Under
// writeMu.
func (c *directConn) writable() error {
	if err := c.writeDone(); err != nil {
		return err
	}
	if c.writeClosed {
		return errors.New("tunnel: write after CloseWrite")
	}
	return nil
}

// writeFailed is what a Write or CloseWrite that failed with err returns:
// before the broker answered, the dial's failure; after, see
// writeFailedInTunnel.
func (c *directConn) writeFailed(err error) error {
	if c.outcome.Load() != dialEstablished {
		c.failed(err)
		<-c.answered
		if c.err != nil {
			return c.err
		}
	}
	return c.writeFailedInTunnel(err)
}

// CloseWrite sends the dial if nothing has, then half-closes the tunnel:
// the target reads the end of its input.
func (c *directConn) CloseWrite() error {
	if isClosed(c.answered) && c.err != nil {
		return c.err
	}
	if _, _, err := c.sendDial(nil); err != nil {
		c.failed(err)
		return c.err
	}
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	if err := c.writeDone(); err != nil || c.writeClosed {
		return err
	}
	c.writeClosed = true
	if err := c.leg.CloseWrite(); err != nil {
		return c.writeFailed(err)
	}
	return nil
}

// Close ends the tunnel, or the dial under way: a conn whose dial the
// broker answered OK sends its end, and gives the connection back once
// the broker has sent its own (closeTunnel); any other closes it.
func (c *directConn) Close() error {
	c.sendMu.Lock()
	unsent := c.target != nil
	c.target = nil
	c.sendMu.Unlock()
	if unsent {
		// The broker has read nothing: the connection just ends.
		c.finish(dialFailed, status.Error(codes.Canceled, "the connection was closed before its dial was sent"))
	}
	c.finish(dialFailed, errClosedBeforeAnswer)
	if c.outcome.Load() == dialEstablished {
		c.closeTunnel()
		return nil
	}
	c.mu.Lock()
	c.closed, c.letGo = true, true
	c.mu.Unlock()
	c.live.forget(c)
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
// answer, so that it does not cut that read short, and until the tunnel
// lets go of the connection or the broker has half-closed (nothing is left
// to read then, and a goroutine waits for the broker's end).
func (c *directConn) SetReadDeadline(t time.Time) error {
	c.readDL.set(t)
	c.mu.Lock()
	defer c.mu.Unlock()
	c.readDeadline = t
	if c.outcome.Load() == dialEstablished && !c.letGo && !c.awaitingEnd {
		return c.conn.SetReadDeadline(t)
	}
	return nil
}

// SetWriteDeadline bounds Write, until the tunnel lets go of the
// connection.
func (c *directConn) SetWriteDeadline(t time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.letGo {
		return nil
	}
	return c.conn.SetWriteDeadline(t)
}
