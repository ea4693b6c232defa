package wire

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// ErrSparesRefused, wrapped in an error of SparesConfig.Open, says that the
// far end takes no spares at all (the agent's broker picked another
// protocol, or another replica answered): asking again would only repeat
// the refusal, so the pool stops opening spares for good and closes those
// it holds.
var ErrSparesRefused = errors.New("the far end takes no spare connections")

// ReplaceAfterTake is how long kcpplugin's and the agent's pools wait
// after a spare is taken before they open its replacement, and so how
// long a tunnel may take to give its connection back (Spares.Return)
// without costing a handshake. The replacement is a TLS handshake, about
// 0.7 ms of CPU on each side, and opened at once it runs while the
// connection that took the spare makes its own start: the dial, the first
// bytes, the caller's TLS handshake with the target through it. On two
// cores that made a new connection at a webhook client's pace (dials half
// a second apart, each on spares) 1.4-1.6x as slow as remotedialer's;
// 20 ms later, once that start is over, 0.83-0.94x (docs/perf-history.md,
// "Issue 18: spares replaced after the connection that took them has
// started"). A short tunnel (a dial, a webhook call, its close) is back
// well within it, and is replaced by nothing.
const ReplaceAfterTake = 20 * time.Millisecond

// SparesConfig is what a Spares pool needs of its user: how to open, read
// and close a spare connection of type S whose first answer is an A, and
// the pace, clock and stop signal of the filling. Open, Pace and After run
// in the pool's one filling goroutine, so one handshake at a time; Read,
// and Lost, in a spare's watching goroutine; Close in either.
type SparesConfig[S, A any] struct {
	// Want is how many idle spares the pool keeps, replacing each one
	// taken or lost.
	Want int
	// Open opens one spare, ready for use. ctx ends when the pool
	// closes. An error that wraps ErrSparesRefused ends the filling.
	Open func(ctx context.Context) (S, error)
	// Read blocks until s's first answer, and returns it: the far end
	// sends nothing before it, so a Read that returns while s is idle
	// says that s is lost, and what it returns says why. Close must end
	// it.
	Read func(s S) A
	// Close closes a spare the pool drops: lost while idle, or idle when
	// the pool closes. A spare taken is its taker's to close.
	Close func(s S)
	// Lost, if set, hears what Read returned for each spare lost while
	// idle, after Close: for the user's log.
	Lost func(answer A)
	// Serve, if set, is for spares the far end takes: an answer read
	// while the spare is idle for which Taken says so (the broker's dial
	// order on an agent's data connection) takes it as Take would, and
	// Serve runs with it in the spare's watching goroutine, which is its
	// to keep. It gives the spare back to p (Return) or closes it.
	Serve func(p *Spares[S, A], s *Spare[S, A], answer A)
	// Taken says whether an answer Read returned takes the spare (an
	// order) rather than loses it; set with Serve.
	Taken func(answer A) bool
	// Pace is how long to wait before the next Open: taken says that a
	// spare was taken since the last call, setback that the last Open
	// failed or a spare was lost since. Nil never waits.
	Pace func(taken, setback bool) time.Duration
	// AfterTake holds back the Open that replaces a taken spare this long
	// after the take, and opens none if the spare has come back by then
	// (Return): see ReplaceAfterTake.
	AfterTake time.Duration
	// After is the clock Pace's waits use, as time.After, which nil
	// means: tests give a fake one.
	After func(time.Duration) <-chan time.Time
	// Stop, once closed, ends the filling and closes the idle spares as
	// the pool's context ending does, but leaves an Open under way to
	// finish: the agent's drain.
	Stop <-chan struct{}
}

// Spares is a pool of connections opened ahead of use, so that a use does
// not wait for a handshake: up to Want of them idle, each watched by a
// goroutine of its own that reads its first answer. Before a spare is
// taken, that read ending means the far end lost it, and the pool replaces
// it; after, the answer is the taker's (Spare.OnAnswer). A connection
// whose tunnel has ended and left it idle comes back (Return). A nil
// *Spares holds none.
type Spares[S, A any] struct {
	cfg      SparesConfig[S, A]
	ctx      context.Context
	cancel   context.CancelFunc
	wake     chan struct{} // a spare was taken or lost
	done     chan struct{} // fill has returned
	watchers sync.WaitGroup

	mu     sync.Mutex
	idle   []*Spare[S, A]
	closed bool
	// lost and taken say what happened since fill last looked.
	lost, taken bool
	// takes numbers the takes; out holds the spares taken and not yet
	// returned that fill still expects back (see roomAfter).
	takes uint64
	out   map[*Spare[S, A]]struct{}
}

// Where a spare is in its life: idle in the pool, taken, or lost (ended
// while idle, or closed by the pool). Only idle moves, once.
const (
	spareIdle int32 = iota
	spareTaken
	spareLost
)

// Spare is one spare a Take returned, now the caller's: its connection,
// and the hand-off of the first answer its watching goroutine reads.
type Spare[S, A any] struct {
	conn  S
	seq   uint64 // which take took it
	state atomic.Int32
	// to hands the watching goroutine whoever takes the answer.
	to chan func(A)
}

// Conn is the spare's connection, which the taker uses and closes.
func (s *Spare[S, A]) Conn() S { return s.conn }

// OnAnswer has fn take the spare's first answer, in the spare's watching
// goroutine, once read; that goroutine is then fn's to keep (the agent's
// copier from the broker runs on in it). Call it once, with nil if nothing
// is to take the answer after all, which frees the goroutine.
func (s *Spare[S, A]) OnAnswer(fn func(A)) { s.to <- fn }

// NewSpares starts filling a pool as cfg says, until ctx ends, Stop closes
// or Close is called.
func NewSpares[S, A any](ctx context.Context, cfg SparesConfig[S, A]) *Spares[S, A] {
	if cfg.After == nil {
		cfg.After = time.After
	}
	if cfg.Pace == nil {
		cfg.Pace = func(bool, bool) time.Duration { return 0 }
	}
	ctx, cancel := context.WithCancel(ctx)
	p := &Spares[S, A]{cfg: cfg, ctx: ctx, cancel: cancel, wake: make(chan struct{}, 1), done: make(chan struct{}),
		out: map[*Spare[S, A]]struct{}{}}
	go p.fill()
	return p
}

// Close stops the filling, closes the idle spares, and waits for every
// watching goroutine to have read its spare's answer: at once for the
// idle ones, and for a taken one when its answer comes or its taker closes
// it. Taken spares are their takers' to close.
func (p *Spares[S, A]) Close() {
	if p == nil {
		return
	}
	p.cancel()
	<-p.done
	p.watchers.Wait()
}

// Take returns an idle spare, now the caller's, who must call its
// OnAnswer; nil if there is none.
func (p *Spares[S, A]) Take() *Spare[S, A] {
	if p == nil {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for !p.closed && len(p.idle) > 0 {
		s := p.idle[0]
		p.idle = slices.Delete(p.idle, 0, 1)
		// A spare whose far end just closed it is being lost: skip it.
		if p.takeLocked(s) {
			return s
		}
	}
	return nil
}

// takeIdle takes s, which the far end took with its answer, out of the
// idle spares; false if it is no longer idle (the pool closed it).
func (p *Spares[S, A]) takeIdle(s *Spare[S, A]) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.idle = slices.DeleteFunc(p.idle, func(i *Spare[S, A]) bool { return i == s })
	return p.takeLocked(s)
}

// takeLocked marks s taken, and has it replaced unless it comes back in
// time (roomAfter). Under mu.
func (p *Spares[S, A]) takeLocked(s *Spare[S, A]) bool {
	if !s.state.CompareAndSwap(spareIdle, spareTaken) {
		return false
	}
	p.taken = true
	p.takes++
	s.seq = p.takes
	p.out[s] = struct{}{}
	p.signal()
	return true
}

// Full says whether the pool holds all the spares it wants, so that a
// use now takes one: for tests and readiness checks.
func (p *Spares[S, A]) Full() bool {
	if p == nil {
		return false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.idle) >= p.cfg.Want
}

// Return gives back a spare taken from the pool whose connection is idle
// again, its tunnel over (docs/protocol.md §3.7): the pool keeps it as an
// idle spare, watched anew, or closes it if it holds Want already or is
// closed. The taker no longer uses the connection either way.
func (p *Spares[S, A]) Return(s *Spare[S, A]) {
	p.mu.Lock()
	delete(p.out, s)
	if p.closed || len(p.idle) >= p.cfg.Want {
		p.mu.Unlock()
		p.cfg.Close(s.conn)
		return
	}
	p.idleLocked(s.conn)
	p.mu.Unlock()
}

func (p *Spares[S, A]) signal() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// fill opens spares while there are fewer than wanted, waiting before each
// as Pace says, until the pool stops or the far end refuses spares for
// good. Then it closes the spares left. While spares are out, it first
// waits AfterTake, and opens none if those it expects back fill the pool.
func (p *Spares[S, A]) fill() {
	defer close(p.done)
	defer p.closeAll()
	setback, lost, taken := false, false, false
	for p.waitForRoom() {
		l, t := p.news()
		lost, taken = lost || l, taken || t
		if mark, out := p.mark(); taken || out {
			if !p.sleep(p.cfg.AfterTake) {
				return
			}
			if !p.roomAfter(mark) {
				continue
			}
		}
		if !p.sleep(p.cfg.Pace(taken, setback || lost)) {
			return
		}
		lost, taken = false, false
		err := p.add()
		if p.ctx.Err() != nil || errors.Is(err, ErrSparesRefused) {
			return
		}
		setback = err != nil
	}
}

// mark is the number of the last take, and whether any spare is out.
func (p *Spares[S, A]) mark() (uint64, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.takes, len(p.out) > 0
}

// roomAfter says whether the pool has room for another spare, counting
// the spares taken after the take numbered mark, and not yet returned, as
// on their way back: fill took mark at least AfterTake ago. The spares
// taken before it that are still out carry long tunnels, and it forgets
// them.
func (p *Spares[S, A]) roomAfter(mark uint64) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for s := range p.out {
		if s.seq <= mark {
			delete(p.out, s)
		}
	}
	return len(p.idle)+len(p.out) < p.cfg.Want
}

// news reads and clears what happened to the spares since the last call.
func (p *Spares[S, A]) news() (lost, taken bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	lost, taken = p.lost, p.taken
	p.lost, p.taken = false, false
	return lost, taken
}

// waitForRoom waits until the pool holds fewer spares than wanted; false
// once the pool stops.
func (p *Spares[S, A]) waitForRoom() bool {
	for {
		p.mu.Lock()
		room := len(p.idle) < p.cfg.Want
		p.mu.Unlock()
		if room {
			return p.sleep(0)
		}
		select {
		case <-p.wake:
		case <-p.ctx.Done():
			return false
		case <-p.cfg.Stop:
			return false
		}
	}
}

// sleep waits d; false if the pool stops first.
func (p *Spares[S, A]) sleep(d time.Duration) bool {
	select {
	case <-p.ctx.Done():
		return false
	case <-p.cfg.Stop:
		return false
	default:
	}
	if d <= 0 {
		return true
	}
	select {
	case <-p.cfg.After(d):
		return true
	case <-p.ctx.Done():
		return false
	case <-p.cfg.Stop:
		return false
	}
}

// add opens a spare and puts it in the pool, watched.
func (p *Spares[S, A]) add() error {
	conn, err := p.cfg.Open(p.ctx)
	if err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		p.cfg.Close(conn)
		return nil
	}
	p.idleLocked(conn)
	return nil
}

// idleLocked puts conn in the pool as an idle spare, watched. Under mu.
func (p *Spares[S, A]) idleLocked(conn S) {
	s := &Spare[S, A]{conn: conn, to: make(chan func(A), 1)}
	p.idle = append(p.idle, s)
	p.watchers.Add(1)
	go p.watch(s)
}

// watch waits for the far end's answer on s. Before s is taken, the read
// ending means s is lost; after, the answer goes to the taker. A spare the
// pool closed while idle is lost too: its read ends, and nothing waits.
func (p *Spares[S, A]) watch(s *Spare[S, A]) {
	answer := p.cfg.Read(s.conn)
	if p.cfg.Serve != nil && p.cfg.Taken(answer) && p.takeIdle(s) {
		p.watchers.Done()
		p.cfg.Serve(p, s, answer)
		return
	}
	if s.state.CompareAndSwap(spareIdle, spareLost) {
		p.lose(s, answer)
	}
	p.watchers.Done()
	if s.state.Load() != spareTaken {
		return
	}
	if fn := <-s.to; fn != nil {
		fn(answer)
	}
}

// lose drops a spare that ended before it was taken, and has it replaced.
func (p *Spares[S, A]) lose(s *Spare[S, A], answer A) {
	p.mu.Lock()
	p.idle = slices.DeleteFunc(p.idle, func(i *Spare[S, A]) bool { return i == s })
	p.lost = true
	p.mu.Unlock()
	p.cfg.Close(s.conn)
	if p.cfg.Lost != nil {
		p.cfg.Lost(answer)
	}
	p.signal()
}

// closeAll closes the idle spares, and has Take find none from now on.
func (p *Spares[S, A]) closeAll() {
	p.mu.Lock()
	idle := p.idle
	p.idle, p.closed = nil, true
	p.mu.Unlock()
	for _, s := range idle {
		if s.state.CompareAndSwap(spareIdle, spareLost) {
			p.cfg.Close(s.conn)
		}
	}
}
