package registry

import (
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// A Carrier is an idle data connection bound to an agent's registration
// (docs/protocol.md §3.5), which takes a dial order where the control
// stream would: Carry sends the order on the connection, and the
// connection's own goroutine then reads the agent's answer and claims the
// dial (Claim) or fails it (Fail), as a Tunnel stream's open or a
// dial_failure on the control stream does. A dial so saves the control
// stream's crossing of gRPC, and the open's round trip.
type Carrier interface {
	// Carry sends order, once. It returns at once: its failure, the
	// connection's, is the connection goroutine's to report.
	Carry(order *tunnelv1.DialOrder)
	// Drop closes the connection while it is idle: its registration has
	// ended.
	Drop()
}

// AddCarrier makes c carry one of the agent's next dial orders; false once
// the registration has ended, and c is not kept.
func (a *Agent) AddCarrier(c Carrier) bool {
	a.carrierMu.Lock()
	defer a.carrierMu.Unlock()
	if a.carriersDropped {
		return false
	}
	a.carriers = append(a.carriers, c)
	return true
}

// RemoveCarrier takes c back unless an order took it first: true if c was
// still idle.
func (a *Agent) RemoveCarrier(c Carrier) bool {
	a.carrierMu.Lock()
	defer a.carrierMu.Unlock()
	for i, x := range a.carriers {
		if x == c {
			a.carriers = append(a.carriers[:i], a.carriers[i+1:]...)
			return true
		}
	}
	return false
}

// takeCarrier takes the carrier idle the shortest, whose connection is
// the likeliest to be warm; nil if there is none.
func (a *Agent) takeCarrier() Carrier {
	a.carrierMu.Lock()
	defer a.carrierMu.Unlock()
	n := len(a.carriers)
	if n == 0 {
		return nil
	}
	c := a.carriers[n-1]
	a.carriers = a.carriers[:n-1]
	return c
}

// dropCarriers drops every idle carrier, once the registration has ended,
// and keeps none from now on.
func (a *Agent) dropCarriers() {
	a.carrierMu.Lock()
	idle := a.carriers
	a.carriers, a.carriersDropped = nil, true
	a.carrierMu.Unlock()
	for _, c := range idle {
		c.Drop()
	}
}
