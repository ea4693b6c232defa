//go:build !linux

package main

import "time"

// hopTimer waits until an instant (see hoptimer_linux.go; elsewhere, with
// time.Sleep, whose waits under a millisecond may take one).
type hopTimer struct{}

func (*hopTimer) waitUntil(t time.Time) { time.Sleep(time.Until(t)) }

func (*hopTimer) close() {}
