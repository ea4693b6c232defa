package identity

import (
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// HandOver is l for a gRPC server whose credentials Dispatch connections:
// it tells Dispatch when gRPC is done with a connection it handed over.
// gRPC sets a deadline on every connection it accepts for the handshake,
// and clears it once the handshake has returned, dispatched ones included;
// a function served before that clear could see a deadline of its own
// cleared with it.
func HandOver(l net.Listener) net.Listener { return handOverListener{l} }

type handOverListener struct{ net.Listener }

func (l handOverListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &handedConn{Conn: c, released: make(chan struct{})}, nil
}

// handedConn is an accepted connection that says when gRPC, having had it
// dispatched, clears its deadline: the last thing gRPC does with it.
type handedConn struct {
	net.Conn
	dispatched atomic.Bool
	release    sync.Once
	released   chan struct{}
}

func (c *handedConn) SetDeadline(t time.Time) error {
	err := c.Conn.SetDeadline(t)
	if t.IsZero() && c.dispatched.Load() {
		c.release.Do(func() { close(c.released) })
	}
	return err
}

// SetLinger is the TCP socket's, for the resets of data and dial
// connections (wire.Socket).
func (c *handedConn) SetLinger(sec int) error {
	if l, ok := c.Conn.(interface{ SetLinger(int) error }); ok {
		return l.SetLinger(sec)
	}
	return errors.ErrUnsupported
}

// maxHandOver bounds the wait for gRPC's clear, should a gRPC version not
// make it: the function then runs as it would without HandOver.
const maxHandOver = time.Second

// handingOver marks raw as dispatched and returns what waits until gRPC
// is done with it; on a connection a HandOver listener did not accept, it
// waits for nothing.
func handingOver(raw net.Conn) (wait func()) {
	c, ok := raw.(*handedConn)
	if !ok {
		return func() {}
	}
	c.dispatched.Store(true)
	return func() {
		timer := time.NewTimer(maxHandOver)
		defer timer.Stop()
		select {
		case <-c.released:
		case <-timer.C:
		}
	}
}
