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

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

const (
	// maxFrame is the largest data frame a Write sends; larger writes are
	// split. Frames well below gRPC's 4 MiB message limit keep latency low
	// for other tunnels sharing the connection.
	maxFrame = 32 << 10
	// closeLinger is how long a closed conn keeps its stream open so that
	// bytes written before Close, and the half-close after them, still
	// arrive. The stream is cancelled when it runs out.
	closeLinger = 2 * time.Second
)

// conn is a net.Conn over one Dial stream.
type conn struct {
	stream tunnelv1.DialService_DialClient
	cancel context.CancelFunc
	local  net.Addr
	remote net.Addr

	// The receive goroutine hands frames to Read one at a time; gRPC's flow
	// control holds back the rest, so a slow reader stalls only its tunnel.
	frames  chan []byte
	readErr error // set before frames is closed: io.EOF or the stream's status
	readMu  sync.Mutex
	unread  []byte
	readDL  *deadline

	writeMu     sync.Mutex
	writeDL     *deadline
	writeClosed bool
	writeErr    error // sticky after a write failed or timed out

	closeOnce sync.Once
	closed    chan struct{}
	received  chan struct{} // closed when the receive goroutine is done
}

func newConn(stream tunnelv1.DialService_DialClient, cancel context.CancelFunc, remote net.Addr) *conn {
	c := &conn{
		stream:   stream,
		cancel:   cancel,
		local:    addr("kcp-tunnel-client"),
		remote:   remote,
		frames:   make(chan []byte),
		readDL:   newDeadline(),
		writeDL:  newDeadline(),
		closed:   make(chan struct{}),
		received: make(chan struct{}),
	}
	go c.receive()
	return c
}

// receive runs for the life of the stream: it hands data to Read until the
// peer half-closes, then drains the stream to its final status.
func (c *conn) receive() {
	defer close(c.received)
	defer c.cancel()
	open := true // frames not yet closed
	finish := func(err error) {
		if open {
			c.readErr = err
			close(c.frames)
			open = false
		}
	}
	for {
		msg, err := c.stream.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) {
				// A clean end always follows the peer's close_write, but
				// should it not, it still means no more data.
				finish(io.EOF)
			} else {
				finish(streamError(err))
			}
			return
		}
		switch f := msg.GetFrame().(type) {
		case *tunnelv1.DialResponse_Data:
			if !open {
				c.cancel() // data after close_write: the broker is broken
				continue
			}
			select {
			case c.frames <- f.Data:
			case <-c.closed:
				// Nobody reads any more: discard until the stream ends.
			}
		case *tunnelv1.DialResponse_CloseWrite:
			finish(io.EOF)
		default:
			finish(status.Errorf(codes.Internal, "protocol error: unexpected %T from broker", f))
			c.cancel()
		}
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
	if len(c.unread) == 0 {
		select {
		case <-c.closed:
			return 0, net.ErrClosed
		default:
		}
		select {
		case data, ok := <-c.frames:
			if !ok {
				return 0, c.readErr
			}
			c.unread = data
		case <-c.readDL.wait():
			return 0, os.ErrDeadlineExceeded
		case <-c.closed:
			return 0, net.ErrClosed
		}
	}
	n := copy(b, c.unread)
	c.unread = c.unread[n:]
	return n, nil
}

// Write implements net.Conn. A write deadline that passes while Write is
// blocked aborts the tunnel, as a timed-out write leaves a TLS conn unusable
// anyway.
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
	}
	if at := c.writeDL.time(); !at.IsZero() {
		abort := time.AfterFunc(time.Until(at), c.cancel)
		defer abort.Stop()
	}

	written := 0
	for len(b) > 0 {
		chunk := b[:min(len(b), maxFrame)]
		if err := c.stream.Send(&tunnelv1.DialRequest{Frame: &tunnelv1.DialRequest_Data{Data: chunk}}); err != nil {
			if isClosed(c.writeDL.wait()) {
				c.writeErr = os.ErrDeadlineExceeded
			} else {
				c.writeErr = c.sendError()
			}
			return written, c.writeErr
		}
		written += len(chunk)
		b = b[len(chunk):]
	}
	return written, nil
}

// sendError is what a failed Send means: Send reports only io.EOF, and the
// stream's status comes from the receive side.
func (c *conn) sendError() error {
	<-c.received
	if c.readErr != nil && c.readErr != io.EOF {
		return c.readErr
	}
	return net.ErrClosed
}

// CloseWrite half-closes the tunnel: the target reads EOF, and this side may
// still read.
func (c *conn) CloseWrite() error {
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	if c.writeClosed || c.writeErr != nil {
		return nil
	}
	c.writeClosed = true
	return c.stream.CloseSend()
}

// Close implements net.Conn. Bytes already written still reach the target,
// followed by EOF; the stream ends once the target closes too, or after
// closeLinger.
func (c *conn) Close() error {
	c.closeOnce.Do(func() {
		close(c.closed)
		if c.writeMu.TryLock() {
			if !c.writeClosed && c.writeErr == nil {
				c.writeClosed = true
				_ = c.stream.CloseSend()
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
