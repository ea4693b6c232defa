package main

import (
	"os"
	"syscall"
	"time"
	"unsafe"
)

// hopTimer waits until an instant to within tens of µs. time.Sleep does
// not: while a process idles, Go's runtime waits in epoll with a timeout in
// whole milliseconds, so a sleep of 250µs takes over 1ms. A timerfd read
// through the runtime's poller wakes the waiter when the kernel's timer
// fires. It is made on the first wait that needs it; without one (the
// kernel refused), waits fall back to time.Sleep.
type hopTimer struct {
	f      *os.File
	fd     int
	failed bool
}

// itimerspec is the kernel's struct itimerspec.
type itimerspec struct {
	interval, value syscall.Timespec
}

// waitUntil returns once t has passed.
func (h *hopTimer) waitUntil(t time.Time) {
	d := time.Until(t)
	if d <= 0 {
		return
	}
	if h.f == nil && !h.failed {
		fd, _, errno := syscall.Syscall(syscall.SYS_TIMERFD_CREATE, 1 /* CLOCK_MONOTONIC */, syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
		if errno != 0 {
			h.failed = true
		} else {
			h.fd, h.f = int(fd), os.NewFile(fd, "timerfd")
		}
	}
	if h.f == nil {
		time.Sleep(d)
		return
	}
	its := itimerspec{value: syscall.NsecToTimespec(int64(d))}
	if _, _, errno := syscall.Syscall6(syscall.SYS_TIMERFD_SETTIME, uintptr(h.fd), 0, uintptr(unsafe.Pointer(&its)), 0, 0, 0); errno != 0 {
		time.Sleep(d)
		return
	}
	var b [8]byte
	if _, err := h.f.Read(b[:]); err != nil {
		time.Sleep(time.Until(t))
	}
}

// close releases the timer.
func (h *hopTimer) close() {
	if h.f != nil {
		h.f.Close()
	}
}
