package agent

import (
	"fmt"
	"io"
	"net"
	"testing"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// This file holds the fake broker's side of one tunnel on a data
// connection (docs/protocol.md §3.5, §3.7): the answer to the open, the
// tunnel's frames each way, the end exchange, and the hand-back of the
// connection to the broker's goroutine that reads the next open.

// dispatchedConn is what identity.Dispatch hands a broker.
type dispatchedConn interface {
	net.Conn
	CloseWrite() error
	NetConn() net.Conn
}

// dataLeg is the broker's side of one tunnel on a data connection, from
// its open on.
type dataLeg struct {
	// conn is what identity.Dispatch hands the broker: TLS, with the
	// socket under it.
	conn   dispatchedConn
	peer   spiffeid.ID
	dialID uint64
	// connNo numbers the data connection that carries the tunnel, in the
	// order the broker accepted them: tunnels with the same connNo rode
	// one connection.
	connNo int32
	frames wire.FrameReader
	// done closes once the test is done with the tunnel and its
	// connection is idle: the broker's goroutine then reads the next open.
	done chan struct{}
}

// answer answers the open: nil is OK.
func (l *dataLeg) answer(t *testing.T, err error) {
	t.Helper()
	if err := wire.WriteOpenResult(l.conn, err); err != nil {
		t.Fatalf("answering the open: %v", err)
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
	kind, end, err := l.frames.Next(l.conn)
	if err != nil {
		return agentFrame{}, err
	}
	if kind != wire.FrameData {
		return agentFrame{kind: kind, end: end}, nil
	}
	data := make([]byte, l.frames.Unread())
	for read := 0; read < len(data); {
		n, err := l.frames.Read(l.conn, data[read:])
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
// returns its status. The connection is idle then, and the broker reads
// the next open on it.
func (l *dataLeg) finish(t *testing.T, err error) error {
	t.Helper()
	l.end(t, err)
	agentEnd := l.awaitEnd(t)
	l.reused()
	return agentEnd
}

// reused hands the connection, idle, back to the broker's goroutine that
// reads the next open on it.
func (l *dataLeg) reused() { close(l.done) }

// connEnd reads the connection until it ends, and returns how: a reset,
// a close_notify (io.EOF), or the deadline nextDataLeg set.
func (l *dataLeg) connEnd() error {
	_, err := io.Copy(io.Discard, l.conn)
	if err == nil {
		err = io.EOF
	}
	return err
}

// reset ends the data connection without a close_notify.
func (l *dataLeg) reset() { l.conn.NetConn().Close() }
