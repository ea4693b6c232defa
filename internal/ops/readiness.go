package ops

import (
	"errors"
	"sync"
)

// Readiness is what /readyz answers: not ready, for the reason given, until
// Set hands it the check of a process that has started. So the health port
// can open before the process has what it needs (its SVID), and a probe or
// a person sees why it is not ready yet.
type Readiness struct {
	mu     sync.Mutex
	reason error
	check  func() error
}

// NewReadiness is not ready, for reason, until Set.
func NewReadiness(reason string) *Readiness {
	return &Readiness{reason: errors.New(reason)}
}

// NotReady changes the reason given until Set.
func (r *Readiness) NotReady(reason string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.reason = errors.New(reason)
}

// Set makes check answer from now on: nil for ready, else why not.
func (r *Readiness) Set(check func() error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.check = check
}

// Check is nil when ready, else the reason.
func (r *Readiness) Check() error {
	r.mu.Lock()
	check, reason := r.check, r.reason
	r.mu.Unlock()
	if check == nil {
		return reason
	}
	return check()
}
