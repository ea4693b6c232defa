package kcpplugin

import "sync"

// liveConns are a Dialer's tunnels on dial connections that are not closed
// yet. Dialer.Close ends them, as closing the gRPC connection ends the
// tunnels on its Dial streams: otherwise a webhook client's idle
// connection would keep its tunnel, and the broker and the agent would
// wait for it when they drain.
type liveConns struct {
	mu     sync.Mutex
	conns  map[*directConn]struct{}
	closed bool
}

// add tracks c until it is closed; false once the Dialer is closed.
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
	c.untrack = func() { l.remove(c) }
	return true
}

func (l *liveConns) remove(c *directConn) {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.conns, c)
}

// closeAll closes every tracked conn, and refuses new ones. A nil
// liveConns (a Dialer without dial connections) has none.
func (l *liveConns) closeAll() {
	if l == nil {
		return
	}
	l.mu.Lock()
	conns := l.conns
	l.conns, l.closed = nil, true
	l.mu.Unlock()
	for c := range conns {
		c.Close()
	}
}
