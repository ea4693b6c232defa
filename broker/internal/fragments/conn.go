package fragments

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"golang.org/x/net/http2"
	"google.golang.org/grpc/credentials"
)

// goAwayTimeout bounds the write of the GOAWAY that says why a connection
// closes, should its peer not read.
const goAwayTimeout = time.Second

// conn is a secured connection gRPC's server reads from and writes to. It
// follows the frames both ways: those it reads to tally the peer's DATA
// frames, those gRPC writes to know where a frame of its own may go.
type conn struct {
	net.Conn
	guard *guard
	peer  string

	// Read is called by one goroutine at a time (gRPC's reader).
	in    *scanner
	tally tally
	over  bool
	err   error // once over, every Read fails with it

	wmu sync.Mutex
	out scanner // what gRPC wrote, under wmu
}

func (g *guard) watch(secured net.Conn, info credentials.AuthInfo) *conn {
	c := &conn{Conn: secured, guard: g, peer: peerName(info)}
	c.in = newServerScanner(func(f http2.FrameHeader, data uint32) {
		if c.tally.add(f, data) {
			c.over = true
		}
	})
	return c
}

// Read reads as the secured connection does, and fails once the peer is
// over its allowance: the bytes that took it over are not handed to gRPC,
// which closes the connection on the error.
func (c *conn) Read(p []byte) (int, error) {
	if c.err != nil {
		return 0, c.err
	}
	n, err := c.Conn.Read(p)
	c.in.scan(p[:n])
	if c.over {
		c.refuse()
		return 0, c.err
	}
	return n, err
}

func (c *conn) Write(p []byte) (int, error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	n, err := c.Conn.Write(p)
	c.out.scan(p[:n])
	return n, err
}

// refuse ends the connection's reads, reports it and tells the peer why.
// It reports first, so that whoever hears of the closing from the peer
// finds it counted already.
func (c *conn) refuse() {
	t := c.tally
	c.err = fmt.Errorf("fragmented data: the peer sent %d DATA frames of fewer than %d bytes of data or padded, "+
		"in %d bytes of data; gRPC would hold %d bytes for them, more than the %d allowed",
		t.fragments, MinData, t.data, t.cost, t.allowance())
	c.guard.closing(c, t)
	c.goAway(c.err.Error())
}

// goAway sends the peer an HTTP/2 GOAWAY (ENHANCE_YOUR_CALM) with debug, if
// it can go now between two of gRPC's frames; otherwise the connection just
// closes. gRPC may write a frame in several pieces, and a write of its may
// wait for a peer that does not read, so a GOAWAY goes out only while no
// write is under way and the last one ended a frame.
func (c *conn) goAway(debug string) {
	if !c.wmu.TryLock() {
		return
	}
	defer c.wmu.Unlock()
	if !c.out.atFrameStart() {
		return
	}
	var frame bytes.Buffer
	if err := http2.NewFramer(&frame, nil).WriteGoAway(c.in.lastStream, http2.ErrCodeEnhanceYourCalm, []byte(debug)); err != nil {
		return
	}
	// The connection is closing: a write that times out breaks nothing
	// more.
	_ = c.Conn.SetWriteDeadline(time.Now().Add(goAwayTimeout))
	n, _ := c.Conn.Write(frame.Bytes())
	c.out.scan(frame.Bytes()[:n])
}

// lingerTimeout bounds how long a refused connection reads what its peer
// still sends before it closes.
const lingerTimeout = time.Second

// Close closes the connection. A refused one first reads, and drops, what
// its peer still sends, until the peer closes or lingerTimeout: the peer is
// likely in the middle of a write, and a socket closed with unread data
// sends a TCP reset, which makes the peer's kernel throw away the GOAWAY
// it has not read yet, and with it the reason (net/http lingers the same
// way before it closes a connection it refused).
func (c *conn) Close() error {
	if c.err != nil {
		_ = c.Conn.SetReadDeadline(time.Now().Add(lingerTimeout))
		_, _ = io.Copy(io.Discard, c.Conn)
	}
	return c.Conn.Close()
}
