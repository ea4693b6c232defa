package kcpplugin

import "sync"

// liveConns are a Dialer's tunnels on dial connections that still hold
// their connection: from the dial until the tunnel has given it back to
// the pool, or closed it. Dialer.Close ends them, as closing the gRPC
// connection ends the tunnels on its Dial streams: otherwise a webhook
// client's idle connection would keep its tunnel, and the broker and the
// agent would wait for it when they drain. It also waits for the
// goroutines that end tunnels in the background (directend.go), so that
// none outlives the Dialer.
type liveConns struct {
	mu     sync.Mutex
	conns  map[*directConn]struct{}
	closed bool
	ending sync.WaitGroup
}

// add tracks c until it lets go of its connection; false once the Dialer
// is closed.
func (l *liveConns) add(c *directConn) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return false
	}
	if l.conns == nil {
		l.conns = map[*directConn]struct{}{}
	}
	l.conns[c] = struct{}{}
	return true
}

// forget stops tracking c, whose tunnel is done with its connection. It
// says whether c was still tracked: false once closeAll has taken it to
// reset its connection, which must then not go back to the pool.
func (l *liveConns) forget(c *directConn) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	_, tracked := l.conns[c]
	delete(l.conns, c)
	return tracked
}

// spawn runs end in a goroutine that closeAll waits for; false, and
// nothing runs, once the Dialer is closed.
func (l *liveConns) spawn(end func()) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return false
	}
	l.ending.Add(1)
	go func() {
		defer l.ending.Done()
		end()
	}()
	return true
}

// closeAll resets every tracked conn's connection, refuses new conns and
// goroutines, and waits for those running: with their connections reset,
// they end at once. A nil liveConns (a Dialer without dial connections)
// has none.
func (l *liveConns) closeAll() {
	if l == nil {
		return
	}
	l.mu.Lock()
	conns := l.conns
	l.conns, l.closed = nil, true
	l.mu.Unlock()
	for c := range conns {
		c.endNow()
	}
	l.ending.Wait()
}
