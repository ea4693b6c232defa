package agent

import (
	"fmt"
	"io"
	"net"
	"testing"

	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// This file holds the fake broker's side of one order on a data
// connection (docs/protocol.md §3.5, §3.7): the agent's answer, the
// tunnel's frames each way, the end exchange, and the hand-back of the
// connection, idle, to the broker's goroutine that keeps it as a spare.

// dispatchedConn is what identity.Dispatch hands a broker.
type dispatchedConn interface {
	net.Conn
	CloseWrite() error
	NetConn() net.Conn
}

// dataLeg is the broker's side of one order sent on a data connection,
// and of the tunnel that follows an OK answer.
type dataLeg struct {
	*dataConn
	frames wire.FrameReader
	// arrived closes once something came on the connection after the
	// order, or it ended: the agent's answer is read from then on.
	arrived chan struct{}
	// done closes once the test is done with the order and its
	// connection is idle: the broker's goroutine keeps it as a spare
	// again.
	done chan struct{}
}

// answer reads the agent's answer to the order: nil for OK, else the
// dial's failure as a status error, or how the connection failed.
func (l *dataLeg) answer(t *testing.T) error {
	t.Helper()
	testutil.Wait(t, "the agent's answer to the order", l.arrived)
	return wire.ReadAnswer(l.r)
}

// accepted reads the agent's answer, which must be OK.
func (l *dataLeg) accepted(t *testing.T) {
	t.Helper()
	if err := l.answer(t); err != nil {
		t.Fatalf("the agent answered the order with %v, want OK", err)
	}
}

// write sends p in data frames.
func (l *dataLeg) write(p []byte) error {
	for len(p) > 0 {
		n := min(len(p), wire.MaxFrame)
		if _, err := l.conn.Write(wire.AppendData(nil, p[:n])); err != nil {
			return err
		}
		p = p[n:]
	}
	return nil
}

// send is write, which must succeed.
func (l *dataLeg) send(t *testing.T, p []byte) {
	t.Helper()
	if err := l.write(p); err != nil {
		t.Fatalf("broker write: %v", err)
	}
}

// closeWrite half-closes the broker's direction.
func (l *dataLeg) closeWrite(t *testing.T) {
	t.Helper()
	if err := wire.WriteCloseWrite(l.conn); err != nil {
		t.Fatalf("broker close_write: %v", err)
	}
}

// end sends the broker's end, with err's status (nil: OK).
func (l *dataLeg) end(t *testing.T, err error) {
	t.Helper()
	if err := wire.WriteEnd(l.conn, err); err != nil {
		t.Fatalf("broker end: %v", err)
	}
}

// agentFrame is a frame the agent sent: data, a close_write, or an end
// with its status (nil: OK).
type agentFrame struct {
	kind wire.FrameKind
	data []byte
	end  error
}

// next reads the agent's next frame.
func (l *dataLeg) next() (agentFrame, error) {
	kind, end, err := l.frames.Next(l.r)
	if err != nil {
		return agentFrame{}, err
	}
	if kind != wire.FrameData {
		return agentFrame{kind: kind, end: end}, nil
	}
	data := make([]byte, l.frames.Unread())
	for read := 0; read < len(data); {
		n, err := l.frames.Read(l.r, data[read:])
		read += n
		if err != nil && read < len(data) {
			return agentFrame{}, err
		}
	}
	return agentFrame{kind: wire.FrameData, data: data}, nil
}

// recvAll returns the agent's bytes until its close_write.
func (l *dataLeg) recvAll() ([]byte, error) {
	var all []byte
	for {
		f, err := l.next()
		switch {
		case err != nil:
			return all, err
		case f.kind == wire.FrameCloseWrite:
			return all, nil
		case f.kind == wire.FrameEnd:
			return all, fmt.Errorf("the agent ended the tunnel (%v) before its close_write", f.end)
		}
		all = append(all, f.data...)
	}
}

// recvN returns the agent's next n bytes.
func (l *dataLeg) recvN(t *testing.T, n int) []byte {
	t.Helper()
	var all []byte
	for len(all) < n {
		f, err := l.next()
		if err != nil || f.kind != wire.FrameData {
			t.Fatalf("after %d of %d bytes, the broker read frame %v, %v; want data", len(all), n, f.kind, err)
		}
		all = append(all, f.data...)
	}
	return all
}

// awaitEnd reads and drops what the agent sends until its end, and
// returns the end's status (nil: OK).
func (l *dataLeg) awaitEnd(t *testing.T) error {
	t.Helper()
	for {
		f, err := l.next()
		if err != nil {
			t.Fatalf("the connection failed before the agent's end: %v", err)
		}
		if f.kind == wire.FrameEnd {
			return f.end
		}
	}
}

// finish ends the tunnel as the broker does, with err's status (nil: OK,
// once both directions have half-closed), reads the agent's end, and
// returns its status. The connection is idle then, a spare again.
func (l *dataLeg) finish(t *testing.T, err error) error {
	t.Helper()
	l.end(t, err)
	agentEnd := l.awaitEnd(t)
	l.reused()
	return agentEnd
}

// reused hands the connection, idle, back to the broker's goroutine that
// keeps it as a spare.
func (l *dataLeg) reused() { close(l.done) }

// connEnd reads the connection until it ends, and returns how: a reset,
// a close_notify (io.EOF), or the deadline orderOnData set.
func (l *dataLeg) connEnd() error {
	<-l.arrived // the broker's goroutine is done with the connection
	_, err := io.Copy(io.Discard, l.r)
	if err == nil {
		err = io.EOF
	}
	return err
}

// reset ends the data connection without a close_notify.
func (l *dataLeg) reset() { l.conn.NetConn().Close() }

// abort resets b's data connection of l with a TCP reset, which fails
// the agent's next write on it.
func (l *dataLeg) abort(t *testing.T, b *fakeBroker) {
	t.Helper()
	sock, ok := b.sockets.Load(l.conn.RemoteAddr().String())
	if !ok {
		t.Fatal("no socket of the data connection")
	}
	if err := sock.(*net.TCPConn).SetLinger(0); err != nil {
		t.Fatal(err)
	}
	l.reset()
}
