// Package splice carries one tunneled connection between two legs, the
// same way in the broker (a caller's leg and its agent's Tunnel stream)
// and in the agent (its Tunnel stream and the target's connection).
//
// Each direction is copied by a goroutine of its own, frame by frame: a
// data frame passes through in its wire encoding, without a copy
// (wire.Frame). A splice ends cleanly once both directions have
// half-closed. Otherwise it ends at its first failure: a leg fails or
// sends something but data, a leg's peer goes away, or the splicer stops
// it (Config.Stop). The end ends both legs, each with its status, which
// frees every copier blocked on either leg whatever the peers do.
package splice

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"

	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// Side names a leg of a splice, to lay a failure to it.
type Side int

const (
	// A and B are the legs in the order Splice takes them.
	A Side = iota
	B
	// Neither: the splicer's own reason (Config.Stop).
	Neither
)

func (s Side) String() string {
	switch s {
	case A:
		return "A"
	case B:
		return "B"
	}
	return "neither"
}

// ErrNotData is the failure of a leg whose peer sent something but
// non-empty data, or than its stream's half-close, after the splice began.
var ErrNotData = wire.ErrNotData

// Failure is the end of a splice that did not end cleanly: the first
// failure, and the leg it is laid to. A Recv that fails, or a peer that
// went away, is laid to the leg received from; a Send or CloseWrite that
// fails, to the leg sent to.
type Failure struct {
	By  Side
	Err error
}

func (f *Failure) Error() string { return fmt.Sprintf("leg %v: %v", f.By, f.Err) }
func (f *Failure) Unwrap() error { return f.Err }

// Config is what a splice needs besides its legs; the zero value will do.
type Config struct {
	// Stop ends the splice, as a failure by Neither with the context's
	// cause, when it ends (the broker's stop, the idle limit). Nil: never.
	Stop context.Context
	// Carried, if set, is told of every data frame forwarded: from which
	// leg, and its payload's length.
	Carried func(from Side, n int)
	// Statuses are the statuses the legs end with for the failure f (nil:
	// a clean end). Nil: f's error for both, nil for a clean end.
	Statuses func(f *Failure) (a, b error)
	// Released, if set, runs once both copiers have returned: on a clean
	// end before either leg is ended, so that before either peer can hear
	// of the end; after a failure as soon as both legs have ended.
	Released func()
	// Inline: the goroutine that calls Splice copies B's direction itself,
	// which saves a goroutine, and its stack, per splice. Only where no
	// leg is a stream served by that goroutine: such a stream's Recv and
	// Send return only once its handler does (the broker's front ends).
	Inline bool
}

// splice is one splice in progress.
type splice struct {
	cfg     Config
	legs    [2]Leg
	copiers atomic.Int32
	mu      sync.Mutex
	ended   bool          // the end is known: a later failure changes nothing
	decided chan struct{} // closed once the end is known and both legs ended
	// Set before decided closes: the first failure (nil for a clean end),
	// and the statuses the legs ended with.
	failure          *Failure
	aStatus, bStatus error
}

// Splice copies each direction between a and b until the splice ends,
// then ends both legs with their statuses (Config.Statuses) and returns the
// failure it ended at (nil: a clean end) and the statuses. It returns
// once the end is decided and both legs are ended (with Inline, once B's
// direction has returned too); the copiers return soon after, and
// Released says when.
func Splice(a, b Leg, cfg Config) (f *Failure, aStatus, bStatus error) {
	s := &splice{cfg: cfg, legs: [2]Leg{a, b}, decided: make(chan struct{})}
	unwatch := s.watch()
	s.copiers.Store(2)
	go s.copy(A)
	if cfg.Inline {
		s.copy(B)
	} else {
		go s.copy(B)
	}
	<-s.decided
	unwatch()
	return s.failure, s.aStatus, s.bStatus
}

func (s *splice) statuses() (a, b error) {
	if s.cfg.Statuses != nil {
		return s.cfg.Statuses(s.failure)
	}
	if s.failure == nil {
		return nil, nil
	}
	return s.failure.Err, s.failure.Err
}

// decide ends the splice with f (nil: cleanly), unless its end is decided
// already: it ends both legs with their statuses, in the goroutine that
// decided, which frees the copiers blocked on them (the Splice's own too,
// with Inline).
func (s *splice) decide(f *Failure) {
	s.mu.Lock()
	if s.ended {
		s.mu.Unlock()
		return
	}
	s.ended, s.failure = true, f
	s.mu.Unlock()
	s.aStatus, s.bStatus = s.statuses()
	s.legs[A].End(s.aStatus)
	s.legs[B].End(s.bStatus)
	close(s.decided)
}

// watch fails the splice when either leg's peer goes away or Stop ends,
// until unwatch. A peer may go away while neither direction waits on its
// leg: a caller that cancels while the other direction is blocked sending
// to a target that does not read, say. On contexts of the standard
// library, AfterFunc starts no goroutine until its context ends.
func (s *splice) watch() (unwatch func()) {
	var stops []func() bool
	for side, leg := range s.legs {
		ctx := leg.Context()
		stops = append(stops, context.AfterFunc(ctx, func() { s.decide(&Failure{By: Side(side), Err: context.Cause(ctx)}) }))
	}
	if stop := s.cfg.Stop; stop != nil {
		stops = append(stops, context.AfterFunc(stop, func() { s.decide(&Failure{By: Neither, Err: context.Cause(stop)}) }))
	}
	return func() {
		for _, stop := range stops {
			stop()
		}
	}
}

// copy runs one direction, from the leg from, in its own goroutine. The
// last copier to return decides a clean end, unless a failure came first.
func (s *splice) copy(from Side) {
	s.forward(from, s.legs[from], s.legs[1-from])
	if s.copiers.Add(-1) == 0 {
		if s.cfg.Released != nil {
			s.cfg.Released()
		}
		s.decide(nil)
	}
}

// forward copies data frames from one leg to the other as they were
// received, without decoding them, until the sender half-closes, and then
// tells the receiver so. The first failure on either leg ends the splice.
func (s *splice) forward(fromSide Side, from, to Leg) {
	toSide := 1 - fromSide
	// One frame for the copier's life, not one per frame forwarded (a
	// frame passed to a leg escapes to the heap): each Recv fills it,
	// and Send or Free takes its buffers.
	f := new(wire.Frame)
	for {
		err := from.Recv(f)
		if errors.Is(err, io.EOF) {
			if err := to.CloseWrite(); err != nil {
				s.decide(&Failure{By: toSide, Err: err})
			}
			return
		}
		if err != nil {
			s.decide(&Failure{By: fromSide, Err: err})
			return
		}
		n, err := f.DataLen()
		if err != nil {
			f.Free()
			s.decide(&Failure{By: fromSide, Err: ErrNotData})
			return
		}
		err = to.Send(f)
		// The leg took the buffers, whether or not it emptied f.
		*f = wire.Frame{}
		if err != nil {
			s.decide(&Failure{By: toSide, Err: err})
			return
		}
		if s.cfg.Carried != nil {
			s.cfg.Carried(fromSide, n)
		}
	}
}
