package registry

import (
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// A Standby is one of an agent's standby Tunnel streams (docs/protocol.md
// §3.2), idle: a dial takes it instead of the control stream, and hands it
// its order, which the stream's RPC writes and whose answer it reads. The
// answer is the agent's open of the dial on that stream (Claim), or a
// dial_failure on its control stream (Fail), as for an order sent there.
// A dial so costs no hop through the control stream's goroutine and no new
// stream on either side.
type Standby struct {
	order chan *tunnelv1.DialOrder // the one order; buffered, never waits
}

// NewStandby is a standby stream's place among its agent's standbys.
func NewStandby() *Standby { return &Standby{order: make(chan *tunnelv1.DialOrder, 1)} }

// Order is where the one order a dial hands the standby arrives.
func (s *Standby) Order() <-chan *tunnelv1.DialOrder { return s.order }

// AddStandby makes s take one of the agent's next dial orders, unless the
// registration has ended or holds max standbys already (max <= 0: none).
func (a *Agent) AddStandby(s *Standby, max int) bool {
	a.standbyMu.Lock()
	defer a.standbyMu.Unlock()
	if a.standbysClosed || len(a.standbys) >= max {
		return false
	}
	a.standbys = append(a.standbys, s)
	return true
}

// RemoveStandby takes s back unless a dial took it first: true if s was
// still idle. One that a dial took has its order, or is about to.
func (a *Agent) RemoveStandby(s *Standby) bool {
	a.standbyMu.Lock()
	defer a.standbyMu.Unlock()
	for i, x := range a.standbys {
		if x == s {
			a.standbys = append(a.standbys[:i], a.standbys[i+1:]...)
			return true
		}
	}
	return false
}

// Standbys is the number of idle standby streams of the registration.
func (a *Agent) Standbys() int {
	a.standbyMu.Lock()
	defer a.standbyMu.Unlock()
	return len(a.standbys)
}

// takeStandby takes the standby idle the shortest, nil if none is.
func (a *Agent) takeStandby() *Standby {
	a.standbyMu.Lock()
	defer a.standbyMu.Unlock()
	n := len(a.standbys)
	if n == 0 || a.standbysClosed {
		return nil
	}
	s := a.standbys[n-1]
	a.standbys = a.standbys[:n-1]
	return s
}

// closeStandbys hands no standby to a dial from now on: the registration
// has ended. The RPCs of those that are idle see the agent gone, and take
// themselves back (RemoveStandby).
func (a *Agent) closeStandbys() {
	a.standbyMu.Lock()
	defer a.standbyMu.Unlock()
	a.standbysClosed = true
}
