package kcpplugin

import (
	"sync"
	"time"
)

// deadline is a net.Conn deadline that a blocked Read can wait on and that
// may be moved while it waits, as net.Pipe's is.
type deadline struct {
	mu     sync.Mutex
	timer  *time.Timer
	passed chan struct{} // closed when the deadline passes
}

func newDeadline() *deadline {
	return &deadline{passed: make(chan struct{})}
}

// set moves the deadline; the zero time means none.
func (d *deadline) set(t time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.timer != nil && !d.timer.Stop() {
		<-d.passed // the timer fired: wait for it to close the channel
	}
	d.timer = nil

	closed := isClosed(d.passed)
	if t.IsZero() {
		if closed {
			d.passed = make(chan struct{})
		}
		return
	}
	if dur := time.Until(t); dur > 0 {
		if closed {
			d.passed = make(chan struct{})
		}
		passed := d.passed
		d.timer = time.AfterFunc(dur, func() { close(passed) })
		return
	}
	if !closed {
		close(d.passed)
	}
}

// wait is closed once the deadline passes. Until then, moving the deadline
// keeps the channel, so a waiter sees the move.
func (d *deadline) wait() <-chan struct{} {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.passed
}

func isClosed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}
