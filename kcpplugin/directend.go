package kcpplugin

import (
	"cmp"
	"errors"
	"io"
	"net"
	"os"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// A tunnel on a dial connection ends with an end from each side
// (docs/protocol.md §3.7), after which the connection is idle and goes
// back to the pool for the next dial, with no new handshake. The broker
// sends its end when the tunnel ends; the conn sends its own when the
// user closes it, or in answer. Whichever comes first, the connection
// goes back as soon as both ends have gone, without waiting for the
// user's Close: a webhook client may keep a connection it has read to its
// end for a long while. A connection that cannot carry another tunnel (a
// frame the protocol does not allow, a failed write, an end that does not
// come within wire.EndTimeout) is reset instead.

// tunnelEnding is where a directConn's tunnel is in its end. Under
// directConn.mu.
type tunnelEnding struct {
	// closed: Close was called (or Dialer.Close), and Read and Write
	// return net.ErrClosed.
	closed bool
	// letGo: the tunnel no longer uses the connection. Its end exchange
	// runs in the background, or it has gone back to the pool, or it was
	// reset; nothing but that exchange may touch it, deadlines included.
	letGo bool
	// awaitingEnd: the broker half-closed, and a goroutine reads on for
	// its end.
	awaitingEnd bool
	// What Read, and Write, return from now on, once set.
	readEnd, writeEnd error
}

// errEndedByBroker is a Write after the broker ended the tunnel with OK:
// both directions had half-closed.
var errEndedByBroker = errors.New("tunnel: the broker ended the tunnel")

// errClosedByCaller is this side's end when the user closes the conn: the
// status a Dial stream's cancellation gives the broker.
var errClosedByCaller = status.Error(codes.Canceled, "the caller closed the connection")

// readDone is what Read returns without reading, if anything.
func (c *directConn) readDone() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return net.ErrClosed
	}
	return c.readEnd
}

// writeDone is what Write returns without writing, if anything.
func (c *directConn) writeDone() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return net.ErrClosed
	}
	return c.writeEnd
}

// settle records what Read and Write return from now on (each unless
// already set), and claims the connection to end the tunnel on it: true
// for the one call that does.
func (c *directConn) settle(readEnd, writeEnd error) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.readEnd = cmp.Or(c.readEnd, readEnd)
	c.writeEnd = cmp.Or(c.writeEnd, writeEnd)
	mine := !c.letGo
	c.letGo = true
	return mine
}

// readEnded is what a Read of the tunnel that ended with err (not a read
// deadline) returns, once it has done what that end asks: the broker's end
// starts the exchange that gives the connection back, its half-close has
// a goroutine wait for its end, and anything else is a broken connection,
// reset at once.
func (c *directConn) readEnded(err error) error {
	if ended, endErr := c.leg.PeerEnded(); ended {
		if c.settle(cmp.Or(endErr, io.EOF), cmp.Or(endErr, errEndedByBroker)) {
			c.finishInBackground()
		}
	} else if err == io.EOF {
		c.brokerHalfClosed()
	} else if !errors.Is(err, wire.ErrTunnelEnded) {
		failure := brokenTunnel(err)
		if c.settle(failure, failure) {
			c.abortTunnel()
		}
	}
	// wire.ErrTunnelEnded: the connection was let go meanwhile (Close,
	// Dialer.Close, a failed Write), which set what Read returns.
	return cmp.Or(c.readDone(), err)
}

// brokerHalfClosed has a goroutine read on for the broker's end, which
// comes once this side is done too: Read has nothing more to read, so no
// Read would see it.
func (c *directConn) brokerHalfClosed() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.readEnd = cmp.Or(c.readEnd, io.EOF)
	if c.letGo || c.awaitingEnd {
		return
	}
	c.awaitingEnd = true
	// The user's read deadline would cut that wait short.
	_ = c.conn.SetReadDeadline(time.Time{})
	// A Dialer that is closing resets the connection: nothing to wait for.
	c.live.spawn(c.awaitEnd)
}

// awaitEnd reads the broker's end after its half-close, then completes the
// exchange and gives the connection back, unless Close has let go of it
// meanwhile; a connection that fails first is reset.
func (c *directConn) awaitEnd() {
	err := c.leg.AwaitEnd()
	if ended, endErr := c.leg.PeerEnded(); ended {
		if c.settle(io.EOF, cmp.Or(endErr, errEndedByBroker)) {
			c.finishTunnel()
		}
		return
	}
	failure := brokenTunnel(err)
	if c.settle(failure, failure) {
		c.abortTunnel()
	}
}

// writeFailedInTunnel is what a Write or CloseWrite of the established
// tunnel that failed with err returns. A Leg that has ended says so, and
// the conn says why it ended. Any other error is the connection's, which
// can carry nothing more (crypto/tls fails every write after one that
// failed, a write deadline's included): the tunnel fails, and the
// connection is reset at once, as a Dial stream is cancelled.
func (c *directConn) writeFailedInTunnel(err error) error {
	if !errors.Is(err, wire.ErrTunnelEnded) {
		failure, writeErr := brokenTunnel(err), err
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			writeErr = failure
		}
		if c.settle(failure, writeErr) {
			c.abortTunnel()
		}
	}
	return cmp.Or(c.writeDone(), err)
}

// brokenTunnel is what a tunnel whose connection failed with err reads as.
// A frame the protocol does not allow is the broker's mistake, Internal as
// a malformed answer to the dial is (wire.ReadDialResult); a connection
// that fails or ends mid-tunnel is Unavailable, as one that ends before
// the answer is.
func brokenTunnel(err error) error {
	if errors.Is(err, wire.ErrBadFrame) {
		return status.Errorf(codes.Internal, "the broker broke the dial connection's protocol: %v", err)
	}
	return status.Errorf(codes.Unavailable, "the broker's dial connection failed: %v", err)
}

// closeTunnel ends the established tunnel as the user closes the conn.
// What the user wrote before Close reaches the target, as TCP's Close and
// a Dial stream's deliver it: a half-close goes first (unless CloseWrite
// sent it), so that the tunnel ends once the target has closed its side
// too, and this side's end right after it, so that the exchange needs
// nothing more of the user; it completes in the background, within
// wire.EndTimeout, as a Dial stream's close lingers. A Write blocked
// meanwhile (on a broker that does not read) would hold them, and Close:
// the connection is reset at once instead, as a Dial stream is cancelled.
// If the broker's end came first, the connection has gone back to the
// pool, or is on its way: Close leaves it alone.
func (c *directConn) closeTunnel() {
	c.mu.Lock()
	c.closed = true
	mine := !c.letGo
	c.letGo = true
	c.mu.Unlock()
	if !mine {
		return
	}
	if !c.writeMu.TryLock() {
		c.abortTunnel()
		return
	}
	defer c.writeMu.Unlock()
	if !c.writeClosed {
		c.writeClosed = true
		if c.leg.CloseWrite() != nil {
			c.abortTunnel()
			return
		}
	}
	if c.leg.End(errClosedByCaller) != nil {
		c.abortTunnel()
		return
	}
	c.finishInBackground()
}

// finishInBackground completes the end exchange in a goroutine that
// Dialer.Close waits for; a Dialer that is closing resets the connection
// instead.
func (c *directConn) finishInBackground() {
	if !c.live.spawn(c.finishTunnel) {
		c.abortTunnel()
	}
}

// finishTunnel completes the end exchange (wire.Leg.Finish) and gives the
// connection back to the pool, or resets it if it cannot carry another
// tunnel, or if the Dialer is closing.
func (c *directConn) finishTunnel() {
	if c.leg.Finish() && c.live.forget(c) {
		c.pool.Return(c.taken)
		return
	}
	c.abortTunnel()
}

// abortTunnel resets the connection: a TCP reset, which the broker reads
// as the tunnel's failure, and no reuse.
func (c *directConn) abortTunnel() {
	c.live.forget(c)
	c.abort()
}

// endNow ends the dial or the tunnel at once, as Dialer.Close does to
// every one not yet closed: the connection is reset, whatever it is
// doing, and Read and Write return net.ErrClosed.
func (c *directConn) endNow() {
	c.finish(dialFailed, status.Error(codes.Canceled, "the dialer was closed"))
	c.mu.Lock()
	c.closed, c.letGo = true, true
	c.mu.Unlock()
	c.abort()
}
