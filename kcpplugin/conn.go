package kcpplugin

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"time"

	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

const (
	// closeLinger is how long a closed conn keeps its stream open so that
	// bytes written before Close, and the half-close after them, still
	// arrive. The stream is cancelled when it runs out.
	closeLinger = 2 * time.Second
)

// conn is a net.Conn over one Dial stream: the one type DialService
// returns. It passes golang.org/x/net/nettest's TestConn
// (nettest_test.go), with no deviation: Close and a passed deadline fail a
// blocked Read or Write at once, with net.ErrClosed or
// os.ErrDeadlineExceeded (a net.Error whose Timeout is true), and a write
// deadline that passes mid-write leaves the tunnel usable (Write).
type conn struct {
	stream tunnelv1.DialService_DialClient
	cancel context.CancelFunc
	local  net.Addr
	remote net.Addr

	// The dial, until the broker answers it (dialer.go).
	dial dialState

	// frames carries data frames from the receive goroutine to Read, one
	// at a time. gRPC's flow control holds back the frames that follow, so
	// a slow reader stalls only its own tunnel.
	frames chan *wire.Frame
	// readErr is what Read returns once it has read every frame: io.EOF,
	// or the error that ended the stream. The receive goroutine sets it
	// before it closes frames.
	readErr error
	// backlog holds the data frames that arrived after a Send failed,
	// until Read takes them. The receive goroutine stops waiting for Read
	// then, because Write waits for the stream's status to say why the
	// Send failed. It is set before frames is closed.
	backlog []*wire.Frame
	// endErr is why the stream ended: io.EOF for a clean end, else the
	// error. It is set before received is closed.
	endErr error

	readMu sync.Mutex
	unread *wire.Frame // a data frame Read has not finished
	readDL *deadline

	writeMu     sync.Mutex
	writeDL     *deadline
	writeClosed bool
	writeErr    error // sticky after a Send failed
	// sending is the last data frame Write handed to gRPC, which may
	// still wait for flow control after Write returned (send).
	sending *sending

	closeOnce  sync.Once
	closed     chan struct{}
	sendFailed chan struct{} // closed after a Send failed: stop holding frames back
	failOnce   sync.Once
	received   chan struct{} // closed when the receive goroutine is done
}

// newConn is the conn of a Dial stream that has not sent target yet: its
// first Write, Read or CloseWrite sends it, and timeout bounds the wait for
// the broker's answer.
// timeout is the dial's, of which remaining is left.
func newConn(stream tunnelv1.DialService_DialClient, cancel context.CancelFunc, target *tunnelv1.Target, timeout, remaining time.Duration, span trace.Span) *conn {
	c := &conn{
		stream:     stream,
		cancel:     cancel,
		local:      addr("kcp-tunnel-client"),
		remote:     addr(target.Key()),
		dial:       dialState{target: target, timeout: timeout, answered: make(chan struct{}), span: span},
		frames:     make(chan *wire.Frame),
		readDL:     newDeadline(),
		writeDL:    newDeadline(),
		closed:     make(chan struct{}),
		sendFailed: make(chan struct{}),
		received:   make(chan struct{}),
	}
	c.dial.timer = time.AfterFunc(remaining, c.dialTimedOut)
	go c.receive()
	return c
}

// receive runs until the stream ends: it waits for the broker to establish
// the tunnel, hands data frames to Read until the broker half-closes, then
// reads on to the stream's final status.
func (c *conn) receive() {
	defer close(c.received)
	defer c.cancel()
	defer c.dial.timer.Stop()
	r := &receiver{conn: c, readsOpen: true, handing: true}
	for {
		// Data frames stay in gRPC's buffers until Read copies them out:
		// one copy, not two (wire.Frame).
		f := new(wire.Frame)
		if err := c.stream.RecvMsg(f); err != nil {
			r.streamEnded(err)
			return
		}
		if r.dial.unanswered() {
			r.answer(f)
		} else if _, err := f.DataLen(); err == nil {
			r.data(f)
		} else {
			r.control(f)
		}
	}
}

// receiver is what the receive goroutine keeps track of.
type receiver struct {
	*conn
	// readsOpen is true until frames is closed: at the broker's
	// close_write, at the end of the stream or at a protocol error.
	readsOpen bool
	// handing is true while data frames go to Read one at a time. Once a
	// Send failed, they go to backlog instead.
	handing bool
	// protocolErr is the broker's protocol error, for which the stream was
	// cancelled.
	protocolErr error
}

// streamEnded records why the stream ended, for Read and Write.
func (r *receiver) streamEnded(err error) {
	switch {
	case r.protocolErr != nil:
		err = r.protocolErr // we cancelled the stream for it
	case r.dial.unanswered():
		err = r.dialFailure(err)
	case errors.Is(err, io.EOF):
		// A clean end always follows the broker's close_write, but should
		// it not, it still means no more data.
		err = io.EOF
	default:
		err = streamError(err)
	}
	if r.dial.unanswered() {
		r.dial.fail(err)
	}
	r.endErr = err
	r.endReads(err)
}

// endReads closes frames, once: Read returns err after the frames it has.
func (r *receiver) endReads(err error) {
	if r.readsOpen {
		r.readErr = err
		close(r.frames)
		r.readsOpen = false
	}
}

// data hands a data frame to Read, or keeps it in backlog once a Send
// failed.
func (r *receiver) data(f *wire.Frame) {
	switch {
	case !r.readsOpen:
		// Data after close_write: the broker is broken.
		f.Free()
		r.protocolErr = status.Error(codes.Internal, "protocol error: data after close_write from broker")
		r.cancel()
	case !r.handing:
		r.backlog = append(r.backlog, f)
	default:
		select {
		case r.frames <- f:
		case <-r.sendFailed:
			r.handing = false
			r.backlog = append(r.backlog, f)
		case <-r.closed:
			// Nobody reads any more: discard until the stream ends.
			f.Free()
		}
	}
}

// control handles a frame that is not data: close_write ends what Read
// returns, empty data is ignored, and anything else is a protocol error.
func (r *receiver) control(f *wire.Frame) {
	var msg tunnelv1.DialResponse
	err := f.Decode(&msg)
	f.Free()
	switch {
	case err == nil && msg.GetCloseWrite() != nil:
		r.endReads(io.EOF)
	case err == nil && msg.GetData() != nil && len(msg.GetData()) == 0:
		// Empty data: nothing to read, and no reason to fail.
	default:
		if r.protocolErr == nil {
			r.protocolErr = status.Errorf(codes.Internal, "protocol error: unexpected %T from broker", msg.GetFrame())
		}
		r.endReads(r.protocolErr)
		r.cancel()
	}
}

// streamError turns the end of the stream into what Read returns.
func streamError(err error) error {
	if status.Code(err) == codes.Canceled {
		return net.ErrClosed
	}
	return fmt.Errorf("tunnel: %w", err)
}

// Read implements net.Conn.
func (c *conn) Read(b []byte) (int, error) {
	c.readMu.Lock()
	defer c.readMu.Unlock()
	// As on a TCP conn, Close and a passed deadline fail a Read even if data
	// is buffered.
	switch {
	case isClosed(c.closed):
		return 0, net.ErrClosed
	case isClosed(c.readDL.wait()):
		return 0, os.ErrDeadlineExceeded
	}
	// A protocol whose server speaks first reads before it writes: the
	// dial must go now, without early data.
	c.sendTarget(nil)
	for c.unread == nil {
		select {
		case f, ok := <-c.frames:
			switch {
			case ok:
				c.unread = f
			case len(c.backlog) > 0:
				c.unread, c.backlog = c.backlog[0], c.backlog[1:]
			default:
				return 0, c.readErr
			}
		case <-c.readDL.wait():
			return 0, os.ErrDeadlineExceeded
		case <-c.closed:
			return 0, net.ErrClosed
		}
	}
	n, _ := c.unread.Read(b)
	if c.unread.Unread() == 0 {
		c.unread.Free()
		c.unread = nil
	}
	return n, nil
}

// Write implements net.Conn. It returns once gRPC has taken every byte of
// b, or when the write deadline passes: then n counts the frame that
// waits for flow control, which still goes, in order, and the tunnel stays
// usable (the next Write, CloseWrite or Close comes after that frame), as
// a TCP socket keeps what it has buffered.
func (c *conn) Write(b []byte) (int, error) {
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	switch {
	case isClosed(c.closed):
		return 0, net.ErrClosed
	case c.writeErr != nil:
		return 0, c.writeErr
	case c.writeClosed:
		return 0, errors.New("tunnel: write after CloseWrite")
	case isClosed(c.writeDL.wait()):
		return 0, os.ErrDeadlineExceeded
	case len(b) == 0:
		return 0, nil
	}
	// A frame an earlier Write left to flow control goes first.
	if err := c.waitSent(); err != nil {
		return 0, err
	}
	// The first Write's first bytes go with the target, as early data.
	written, err := c.sendTarget(b)
	if err != nil {
		c.writeErr = c.sendError(err)
		return 0, c.writeErr
	}
	b = b[written:]
	// Nothing but the early data goes before the broker answers the dial:
	// the broker refuses data frames before established (a pending dial
	// holds no more of ours than the early data), and gRPC can still send
	// the dial to another replica, since its retry buffer holds all that
	// was sent.
	if len(b) > 0 {
		if err := c.waitAnswered(); err != nil {
			return written, err
		}
	}
	for len(b) > 0 {
		chunk := b[:min(len(b), wire.MaxFrame)]
		c.send(chunk)
		switch err := c.waitSent(); {
		case errors.Is(err, os.ErrDeadlineExceeded):
			return written + len(chunk), err
		case err != nil:
			return written, err
		}
		written += len(chunk)
		b = b[len(chunk):]
	}
	return written, nil
}

// sending is one data frame on its way into gRPC.
type sending struct {
	req *tunnelv1.DialRequest
	// encoded is closed once gRPC has encoded req (sendCodec): from then
	// on, gRPC holds a copy of the data and no longer reads the caller's
	// bytes. done is closed when Send returned, err after it is set.
	encoded, done chan struct{}
	err           error
}

// send hands data to gRPC on a goroutine of its own, so that Write can
// return at its deadline while the Send waits for flow control: gRPC's
// Send can only be cut short by ending the stream. c.writeMu is held and
// the previous Send has returned.
func (c *conn) send(data []byte) {
	s := &sending{req: &tunnelv1.DialRequest{Frame: &tunnelv1.DialRequest_Data{Data: data}},
		encoded: make(chan struct{}), done: make(chan struct{})}
	c.sending = s
	go func() {
		defer close(s.done)
		s.err = c.stream.SendMsg(s)
	}()
}

// waitSent waits, under c.writeMu, until the last data frame's Send has
// returned; it returns the Send's failure, net.ErrClosed after Close, or
// os.ErrDeadlineExceeded once the write deadline passes and gRPC has
// encoded the frame, which then goes later.
func (c *conn) waitSent() error {
	s := c.sending
	if s == nil {
		return nil
	}
	var early error
	select {
	case <-s.done:
	case <-c.closed:
		early = net.ErrClosed
	case <-c.writeDL.wait():
		early = os.ErrDeadlineExceeded
	}
	if early != nil {
		// gRPC encodes a message before it waits for flow control, so
		// this wait is short; once encoded, the caller's bytes are free.
		select {
		case <-s.encoded:
		case <-s.done:
		}
		return early
	}
	c.sending = nil
	if s.err != nil {
		c.writeErr = c.sendError(s.err)
		return c.writeErr
	}
	return nil
}

// waitAnswered waits, under c.writeMu, until the broker has answered the
// dial; it returns the dial's failure, net.ErrClosed after Close, or
// os.ErrDeadlineExceeded once the write deadline passes.
func (c *conn) waitAnswered() error {
	select {
	case <-c.dial.answered:
	case <-c.closed:
		return net.ErrClosed
	case <-c.writeDL.wait():
		return os.ErrDeadlineExceeded
	}
	if c.dial.err != nil {
		c.writeErr = c.dial.err
		return c.writeErr
	}
	return nil
}

// closeSend half-closes the stream, under c.writeMu, after the last data
// frame's Send (gRPC's CloseSend must not run beside a Send).
func (c *conn) closeSend() error {
	s := c.sending
	if s == nil || isClosed(s.done) {
		return c.stream.CloseSend()
	}
	go func() {
		<-s.done
		_ = c.stream.CloseSend()
	}()
	return nil
}

// sendCodec is the stream's codec: wire.FrameCodec, which also encodes a
// sending's request and then tells Write so.
type sendCodec struct{ encoding.CodecV2 }

func (c sendCodec) Marshal(v any) (mem.BufferSlice, error) {
	if s, ok := v.(*sending); ok {
		defer close(s.encoded)
		return c.CodecV2.Marshal(s.req)
	}
	return c.CodecV2.Marshal(v)
}

// sendError is what a failed Send means. Send reports io.EOF, and the
// stream's status comes from the receive side. The stream is over, so the
// receive goroutine stops waiting for Read to take its frames and reaches
// the status without a reader.
func (c *conn) sendError(err error) error {
	if !errors.Is(err, io.EOF) {
		return streamError(err)
	}
	c.failOnce.Do(func() { close(c.sendFailed) })
	select {
	case <-c.received:
	case <-c.closed:
		return net.ErrClosed
	}
	if errors.Is(c.endErr, io.EOF) {
		return errors.New("tunnel: the broker ended the stream")
	}
	return c.endErr
}

// CloseWrite half-closes the tunnel: the target reads EOF, and this side may
// still read.
func (c *conn) CloseWrite() error {
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	switch {
	case isClosed(c.closed):
		return net.ErrClosed
	case c.writeErr != nil:
		return c.writeErr
	case c.writeClosed:
		return nil
	}
	c.writeClosed = true
	c.sendTarget(nil) // a failed send is the stream's status, which Read returns
	return c.closeSend()
}

// Close implements net.Conn. Bytes already written still reach the target,
// followed by EOF; the stream ends once the target closes too, or after
// closeLinger.
func (c *conn) Close() error {
	c.closeOnce.Do(func() {
		close(c.closed)
		if c.dial.abandon() {
			// Nothing was dialed: no byte can be owed to the target.
			c.cancel()
		} else if c.writeMu.TryLock() {
			if !c.writeClosed && c.writeErr == nil {
				c.writeClosed = true
				_ = c.closeSend()
			}
			c.writeMu.Unlock()
			time.AfterFunc(closeLinger, c.cancel)
		} else {
			// A Write is blocked on a peer that does not read: abort.
			c.cancel()
		}
	})
	return nil
}

func (c *conn) LocalAddr() net.Addr  { return c.local }
func (c *conn) RemoteAddr() net.Addr { return c.remote }

func (c *conn) SetDeadline(t time.Time) error {
	c.readDL.set(t)
	c.writeDL.set(t)
	return nil
}

func (c *conn) SetReadDeadline(t time.Time) error  { c.readDL.set(t); return nil }
func (c *conn) SetWriteDeadline(t time.Time) error { c.writeDL.set(t); return nil }

// addr is a tunnel endpoint's address.
type addr string

func (a addr) Network() string { return "kcp-tunnel" }
func (a addr) String() string  { return string(a) }
