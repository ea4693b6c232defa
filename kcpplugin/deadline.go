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
	// onPass, if set, runs each time the deadline passes, after passed is
	// closed; it lets a blocked Write be aborted without a watcher goroutine.
	onPass func()
}

func newDeadline(onPass func()) *deadline {
	return &deadline{passed: make(chan struct{}), onPass: onPass}
}

// pass closes passed and runs onPass.
func (d *deadline) pass(passed chan struct{}) {
	close(passed)
	if d.onPass != nil {
		d.onPass()
	}
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
		d.timer = time.AfterFunc(dur, func() { d.pass(passed) })
		return
	}
	if !closed {
		d.pass(d.passed)
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
