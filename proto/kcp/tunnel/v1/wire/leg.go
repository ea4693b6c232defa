package wire

import (
	"cmp"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"time"
)

// ErrTunnelEnded is a write to a tunnel whose end this side has sent, or a
// use of a Leg once its connection has gone on to the next tunnel.
var ErrTunnelEnded = errors.New("the tunnel has ended")

// Leg is one tunnel on a data or dial connection, at the caller or the
// agent, after the broker's OK (docs/protocol.md §3.7): it reads and writes
// the tunnel's bytes in frames, half-closes with a close_write, and ends
// with the end exchange, which leaves the connection idle for the next
// tunnel (Finish). Read and Write may run at once, each in one goroutine
// at a time.
type Leg struct {
	conn net.Conn

	rmu      sync.Mutex
	frames   FrameReader
	eof      bool  // the peer's close_write was read
	peerEnd  bool  // the peer's end was read
	endErr   error // its status; nil for OK
	finished bool  // Finish ran: conn is no longer this Leg's

	wmu      sync.Mutex
	closed   bool // this side's close_write was sent
	ended    bool // this side's end was sent
	detached bool // Finish ran (under wmu too)

	// A read (under rmu) or a write (under wmu) of conn failed, a read
	// deadline aside: the connection cannot carry another tunnel.
	brokenR, brokenW bool
}

// NewLeg is the tunnel that conn carries from now on: conn has just sent
// the open or the dial, whose answer is read from it next (the tunnel's
// own frames may follow the open or the dial at once, and follow an OK
// answer), or read the broker's OK and nothing after it.
func NewLeg(conn net.Conn) *Leg { return &Leg{conn: conn} }

// Read reads the tunnel's bytes: data as it comes, then io.EOF once the
// peer half-closed or ended the tunnel with OK; a peer that ended it with
// another status reads as that status's error.
func (l *Leg) Read(p []byte) (int, error) {
	l.rmu.Lock()
	defer l.rmu.Unlock()
	for {
		switch {
		case l.finished:
			return 0, ErrTunnelEnded
		case l.peerEnd:
			return 0, cmp.Or(l.endErr, io.EOF)
		case l.frames.Unread() > 0:
			n, err := l.frames.Read(l.conn, p)
			l.readFailed(err)
			return n, err
		case l.eof:
			return 0, io.EOF
		}
		if err := l.next(); err != nil {
			return 0, err
		}
	}
}

// next reads the next frame's header, and records a close_write or an end.
// Under rmu.
func (l *Leg) next() error {
	kind, end, err := l.frames.Next(l.conn)
	if err != nil {
		l.readFailed(err)
		return err
	}
	switch {
	case kind == FrameData && l.eof:
		l.brokenR = true
		return errors.Join(ErrBadFrame, errors.New("data after close_write"))
	case kind == FrameCloseWrite && l.eof:
		l.brokenR = true
		return errors.Join(ErrBadFrame, errors.New("a second close_write"))
	case kind == FrameCloseWrite:
		l.eof = true
	case kind == FrameEnd:
		l.peerEnd, l.endErr = true, end
	}
	return nil
}

// readFailed marks the connection broken for a read error other than a
// deadline's, which a later read resumes from. Under rmu.
func (l *Leg) readFailed(err error) {
	if err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
		l.brokenR = true
	}
}

// PeerEnded says whether the peer's end has been read, and with what
// status (nil: OK).
func (l *Leg) PeerEnded() (bool, error) {
	l.rmu.Lock()
	defer l.rmu.Unlock()
	return l.peerEnd, l.endErr
}

// AwaitEnd reads until the peer's end, once this side has read its
// close_write: anything but the end is a protocol error then. It returns
// the end's status, or the connection's error.
func (l *Leg) AwaitEnd() error {
	l.rmu.Lock()
	defer l.rmu.Unlock()
	for !l.peerEnd {
		if l.finished {
			return ErrTunnelEnded
		}
		if l.frames.Unread() > 0 {
			l.brokenR = true
			return errors.Join(ErrBadFrame, errors.New("data after close_write"))
		}
		if err := l.next(); err != nil {
			return err
		}
	}
	return l.endErr
}

// Write writes p to the tunnel in data frames of at most MaxFrame bytes,
// each frame with one write of conn: one TLS record for a small message.
func (l *Leg) Write(p []byte) (int, error) {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	if err := l.writable(); err != nil {
		return 0, err
	}
	bp := frameBufs.Get().(*[]byte)
	defer frameBufs.Put(bp)
	n := 0
	for n < len(p) {
		chunk := p[n:min(len(p), n+MaxFrame)]
		*bp = AppendData((*bp)[:0], chunk)
		if _, err := l.conn.Write(*bp); err != nil {
			l.brokenW = true
			return n, err
		}
		n += len(chunk)
	}
	return n, nil
}

// frameBufs hold a data frame on its way to conn.
var frameBufs = sync.Pool{New: func() any { b := make([]byte, 0, maxFrameHead+MaxFrame); return &b }}

// writable says why this side may not write data now, if it may not.
// Under wmu.
func (l *Leg) writable() error {
	switch {
	case l.ended || l.detached:
		return ErrTunnelEnded
	case l.closed:
		return errors.New("write after close_write")
	}
	return nil
}

// CloseWrite half-closes this side's direction: the peer reads io.EOF
// once it has read the data before it.
func (l *Leg) CloseWrite() error {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	if err := l.writable(); err != nil {
		return err
	}
	l.closed = true
	if err := WriteCloseWrite(l.conn); err != nil {
		l.brokenW = true
		return err
	}
	return nil
}

// End sends this side's end with err's status (nil: OK), once: from now on
// this side sends nothing more of the tunnel. A later End does nothing. A
// peer that reads nothing holds it, and a Write blocked meanwhile, at most
// EndTimeout (boundEnd).
func (l *Leg) End(err error) error {
	l.boundEnd()
	l.wmu.Lock()
	defer l.wmu.Unlock()
	return l.endLocked(err)
}

// boundEnd bounds the writes left to this side, a blocked one and its end,
// by EndTimeout: a peer that has stopped reading would hold them forever.
// A write cut short breaks the connection, which Finish then closes; one
// that ends in time leaves it whole, and Finish clears the deadline.
func (l *Leg) boundEnd() {
	_ = l.conn.SetWriteDeadline(time.Now().Add(EndTimeout))
}

func (l *Leg) endLocked(err error) error {
	if l.ended || l.detached {
		return nil
	}
	l.ended = true
	if err := WriteEnd(l.conn, err); err != nil {
		l.brokenW = true
		return err
	}
	return nil
}

// Finish completes the end exchange: it sends this side's end (OK) unless
// sent, then reads and drops the tunnel's data until the peer's end, for
// at most EndTimeout and EndDrain bytes, and lets go of the connection.
// It says whether the connection is idle and fit for the next tunnel: a
// false one is the caller's to close. A Read blocked meanwhile returns,
// and every later use of the Leg is ErrTunnelEnded. Call it once: a second
// call returns false, whatever became of the connection.
func (l *Leg) Finish() (reusable bool) {
	l.boundEnd()
	l.wmu.Lock()
	_ = l.endLocked(nil)
	l.detached = true
	brokenW := l.brokenW
	l.wmu.Unlock()
	// The deadline frees a Read blocked on a silent peer, and bounds the
	// drain below.
	_ = l.conn.SetReadDeadline(time.Now().Add(EndTimeout))
	l.rmu.Lock()
	defer l.rmu.Unlock()
	if l.finished {
		return false
	}
	l.finished = true
	bp := frameBufs.Get().(*[]byte)
	defer frameBufs.Put(bp)
	drained := 0
	for !l.peerEnd && !l.brokenR && drained <= EndDrain {
		if l.frames.Unread() > 0 {
			n, err := l.frames.Read(l.conn, (*bp)[:cap(*bp)])
			drained += n
			if err != nil {
				l.brokenR = true
			}
			continue
		}
		if err := l.next(); err != nil {
			l.brokenR = true
		}
	}
	if !l.peerEnd || l.brokenR || brokenW {
		return false
	}
	return l.conn.SetDeadline(time.Time{}) == nil
}
