package wire

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// fakeSpare is a spare whose far end the test plays: answer sends its
// first answer, end ends it as a broker that closes it does.
type fakeSpare struct {
	id      int
	answers chan string
	ended   chan struct{}
	endOnce sync.Once
	closed  atomic.Bool
}

func (s *fakeSpare) end() { s.endOnce.Do(func() { close(s.ended) }) }

// read is the spare's first answer, or "ended".
func (s *fakeSpare) read() string {
	select {
	case a := <-s.answers:
		return a
	case <-s.ended:
		return "ended"
	}
}

// farEnd opens fake spares and records what the pool does with them.
type farEnd struct {
	mu     sync.Mutex
	opened []*fakeSpare
	// fail, while set, is every Open's error.
	fail error
	// opens receives each spare opened; lost each answer Lost hears.
	opens chan *fakeSpare
	lost  chan string
}

func newFarEnd() *farEnd {
	return &farEnd{opens: make(chan *fakeSpare, 1000), lost: make(chan string, 1000)}
}

func (f *farEnd) open(ctx context.Context) (*fakeSpare, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fail != nil {
		return nil, f.fail
	}
	s := &fakeSpare{id: len(f.opened), answers: make(chan string, 1), ended: make(chan struct{})}
	f.opened = append(f.opened, s)
	f.opens <- s
	return s, nil
}

func (f *farEnd) setFail(err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fail = err
}

func (f *farEnd) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.opened)
}

// config is a pool of want fake spares of f, which never waits.
func (f *farEnd) config(want int) SparesConfig[*fakeSpare, string] {
	return SparesConfig[*fakeSpare, string]{
		Want: want,
		Open: f.open,
		Read: (*fakeSpare).read,
		Close: func(s *fakeSpare) {
			s.closed.Store(true)
			s.end()
		},
		Lost: func(a string) { f.lost <- a },
	}
}

// startPool starts a pool of cfg, closed when the test ends.
func startPool(t *testing.T, cfg SparesConfig[*fakeSpare, string]) *Spares[*fakeSpare, string] {
	t.Helper()
	p := NewSpares(context.Background(), cfg)
	t.Cleanup(p.Close)
	return p
}

func wait[T any](t *testing.T, what string, c <-chan T) T {
	t.Helper()
	select {
	case v := <-c:
		return v
	case <-time.After(waitLong):
		t.Fatalf("timed out waiting for %s", what)
		panic("unreachable")
	}
}

func eventually(t *testing.T, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitLong)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestSparesFillUpToWantAndReplaceEachOneTaken(t *testing.T) {
	f := newFarEnd()
	p := startPool(t, f.config(2))
	eventually(t, "a full pool", p.Full)
	if n := f.count(); n != 2 {
		t.Fatalf("%d spares opened, want 2", n)
	}
	wait(t, "a spare", f.opens)
	wait(t, "a spare", f.opens)

	s := p.Take()
	if s == nil {
		t.Fatal("a full pool had no spare to take")
	}
	s.OnAnswer(nil)
	defer s.Conn().end() // as its taker closes it
	wait(t, "the taken spare's replacement", f.opens)
	eventually(t, "a full pool again", p.Full)
	if n := f.count(); n != 3 {
		t.Errorf("%d spares opened, want 3: two, and one in place of the one taken", n)
	}
	if s.Conn().closed.Load() {
		t.Error("the pool closed a spare it gave away")
	}
}

func TestTheTakerGetsTheFirstAnswerInTheWatchingGoroutine(t *testing.T) {
	f := newFarEnd()
	p := startPool(t, f.config(1))
	eventually(t, "a full pool", p.Full)
	s := p.Take()
	s.Conn().answers <- "ok"
	got := make(chan string, 1)
	s.OnAnswer(func(a string) { got <- a })
	if a := wait(t, "the answer", got); a != "ok" {
		t.Errorf("the taker got %q, want ok", a)
	}
	select {
	case a := <-f.lost:
		t.Errorf("a taken spare was lost with %q", a)
	default:
	}
}

func TestASpareEndedWhileIdleIsLostClosedAndReplaced(t *testing.T) {
	f := newFarEnd()
	var setbacks atomic.Int32
	cfg := f.config(1)
	cfg.Pace = func(_, setback bool) time.Duration {
		if setback {
			setbacks.Add(1)
		}
		return 0
	}
	p := startPool(t, cfg)
	first := wait(t, "a spare", f.opens)
	first.answers <- "refused"

	if a := wait(t, "Lost", f.lost); a != "refused" {
		t.Errorf("Lost heard %q, want the far end's answer", a)
	}
	if !first.closed.Load() {
		t.Error("the lost spare was not closed")
	}
	wait(t, "the lost spare's replacement", f.opens)
	eventually(t, "a full pool", p.Full)
	if n := setbacks.Load(); n != 1 {
		t.Errorf("Pace heard of %d setbacks, want the loss", n)
	}
	if s := p.Take(); s == nil || s.Conn() == first {
		t.Errorf("Take returned %v, want the replacement", s)
	} else {
		s.OnAnswer(nil)
		s.Conn().end()
	}
}

func TestPaceHearsOfFailedOpensAndTakesAndItsWaitsUseAfter(t *testing.T) {
	f := newFarEnd()
	f.setFail(errors.New("handshake failed"))
	type call struct{ taken, setback bool }
	calls := make(chan call, 100)
	waits := make(chan time.Duration, 100)
	tick := make(chan time.Time)
	cfg := f.config(1)
	cfg.Pace = func(taken, setback bool) time.Duration {
		calls <- call{taken, setback}
		return time.Second
	}
	cfg.After = func(d time.Duration) <-chan time.Time {
		waits <- d
		return tick
	}
	p := startPool(t, cfg)

	if c := wait(t, "Pace", calls); c != (call{}) {
		t.Errorf("the first Pace heard %+v, want nothing", c)
	}
	if d := wait(t, "a wait", waits); d != time.Second {
		t.Errorf("the pool waited %v, want Pace's second", d)
	}
	tick <- time.Time{}
	if c := wait(t, "Pace", calls); c != (call{setback: true}) {
		t.Errorf("after a failed Open, Pace heard %+v, want a setback", c)
	}
	f.setFail(nil)
	wait(t, "a wait", waits)
	tick <- time.Time{}
	eventually(t, "a full pool", p.Full)
	s := p.Take()
	s.OnAnswer(nil)
	s.Conn().end()
	if c := wait(t, "Pace", calls); c != (call{taken: true}) {
		t.Errorf("after a take, Pace heard %+v, want it taken", c)
	}
}

func TestATakenSpareIsReplacedNoSoonerThanAfterTake(t *testing.T) {
	f := newFarEnd()
	waits := make(chan time.Duration, 100)
	tick := make(chan time.Time)
	cfg := f.config(1)
	cfg.AfterTake = time.Minute
	cfg.After = func(d time.Duration) <-chan time.Time {
		waits <- d
		return tick
	}
	p := startPool(t, cfg)
	eventually(t, "a full pool", p.Full)
	wait(t, "a spare", f.opens)

	s := p.Take()
	s.OnAnswer(nil)
	defer s.Conn().end()
	if d := wait(t, "a wait", waits); d != time.Minute {
		t.Errorf("after a take, the pool waited %v, want AfterTake's minute", d)
	}
	if n := f.count(); n != 1 {
		t.Fatalf("%d spares opened before the wait was over, want 1", n)
	}
	tick <- time.Time{}
	replacement := wait(t, "the taken spare's replacement", f.opens)

	// A spare lost while idle is replaced without that wait: no
	// connection is starting on it.
	eventually(t, "a full pool again", p.Full)
	replacement.end()
	wait(t, "the loss", f.lost)
	wait(t, "the lost spare's replacement", f.opens)
	select {
	case d := <-waits:
		t.Errorf("the pool waited %v to replace a lost spare, want no wait", d)
	default:
	}
}

func TestAnOpenRefusedForGoodEndsTheFilling(t *testing.T) {
	f := newFarEnd()
	cfg := f.config(2)
	opens := 0
	cfg.Open = func(ctx context.Context) (*fakeSpare, error) {
		if opens++; opens == 2 {
			return nil, fmt.Errorf("%w: another replica", ErrSparesRefused)
		}
		return f.open(ctx)
	}
	p := NewSpares(context.Background(), cfg)
	first := wait(t, "a spare", f.opens)
	// The pool ends by itself, and closes the spare it held.
	eventually(t, "the held spare to be closed", first.closed.Load)
	if s := p.Take(); s != nil {
		t.Error("Take found a spare after the far end refused them")
	}
	p.Close()
	if opens != 2 {
		t.Errorf("%d opens, want 2: none after the refusal", opens)
	}
}

func TestCloseClosesIdleSparesAndLeavesTakenOnesToTheirTakers(t *testing.T) {
	f := newFarEnd()
	p := NewSpares(context.Background(), f.config(2))
	eventually(t, "a full pool", p.Full)
	taken := p.Take()
	eventually(t, "a full pool again", p.Full)
	taken.Conn().answers <- "ok"
	got := make(chan string, 1)
	taken.OnAnswer(func(a string) { got <- a })

	p.Close()
	f.mu.Lock()
	opened := f.opened
	f.mu.Unlock()
	for _, s := range opened {
		if s != taken.Conn() && !s.closed.Load() {
			t.Errorf("idle spare %d still open after Close", s.id)
		}
	}
	if taken.Conn().closed.Load() {
		t.Error("Close closed a taken spare")
	}
	if p.Take() != nil {
		t.Error("Take found a spare after Close")
	}
	select {
	case <-f.lost:
		t.Error("Close reported the spares it closed as lost")
	default:
	}
	wait(t, "the taken spare's answer", got)
}

func TestStopOrTheContextEndsTheFillingAndClosesIdleSpares(t *testing.T) {
	for name, stop := range map[string]func(cfg *SparesConfig[*fakeSpare, string]) func(){
		"Stop": func(cfg *SparesConfig[*fakeSpare, string]) func() {
			c := make(chan struct{})
			cfg.Stop = c
			return func() { close(c) }
		},
		"context": func(*SparesConfig[*fakeSpare, string]) func() { return nil },
	} {
		t.Run(name, func(t *testing.T) {
			f := newFarEnd()
			cfg := f.config(1)
			end := stop(&cfg)
			ctx, cancel := context.WithCancel(context.Background())
			if end == nil {
				end = cancel
			}
			p := NewSpares(ctx, cfg)
			defer p.Close()
			defer cancel()
			s := wait(t, "a spare", f.opens)
			end()
			eventually(t, "the idle spare to be closed", s.closed.Load)
			if p.Take() != nil {
				t.Error("Take found a spare after the pool stopped")
			}
		})
	}
}

func TestANilPoolHasNoSpares(t *testing.T) {
	var p *Spares[*fakeSpare, string]
	if p.Take() != nil || p.Full() {
		t.Error("a nil pool had spares")
	}
	p.Close()
}

// Each spare a pool opens ends one way, once: taken (the taker gets its
// answer), lost while idle (Lost hears it), or closed idle by Close. A
// spare that ends as it is taken is one or the other, and its watcher
// never waits for ever.
func TestEverySpareIsTakenLostOrClosedExactlyOnce(t *testing.T) {
	f := newFarEnd()
	cfg := f.config(4)
	var lost, answered atomic.Int32
	cfg.Lost = func(string) { lost.Add(1) }
	cfg.Open = func(ctx context.Context) (*fakeSpare, error) {
		s, err := f.open(ctx)
		if err == nil && s.id%2 == 0 {
			s.answers <- "gone" // ends at once, racing the takes
		}
		return s, err
	}
	p := NewSpares(context.Background(), cfg)
	var takes []*Spare[*fakeSpare, string]
	for f.count() < 200 {
		if s := p.Take(); s != nil {
			takes = append(takes, s)
			s.OnAnswer(func(string) { answered.Add(1) })
			if s.Conn().id%2 == 1 {
				s.Conn().end()
			}
		}
	}
	p.Close()
	eventually(t, "the taken spares' answers", func() bool { return int(answered.Load()) == len(takes) })
	closedIdle := 0
	for _, s := range f.opened {
		if s.closed.Load() {
			closedIdle++
		}
	}
	// Lost spares are closed too.
	if n := len(takes) + closedIdle; n != len(f.opened) {
		t.Errorf("%d taken + %d closed by the pool (%d of them lost) of %d opened", len(takes), closedIdle, lost.Load(), len(f.opened))
	}
}

func TestCloseWaitsForATakenSparesAnswerOrItsTakersClose(t *testing.T) {
	f := newFarEnd()
	p := NewSpares(context.Background(), f.config(1))
	eventually(t, "a full pool", p.Full)
	s := p.Take()
	s.OnAnswer(nil)
	closed := make(chan struct{})
	go func() {
		p.Close()
		close(closed)
	}()
	select {
	case <-closed:
		t.Fatal("Close returned while a taken spare's answer was still being read")
	case <-time.After(50 * time.Millisecond):
	}
	s.Conn().end()
	wait(t, "Close to return", closed)
}

// heldPool is a pool of one fake spare whose AfterTake waits for tick, and
// the waits it asked of After.
func heldPool(t *testing.T, f *farEnd) (p *Spares[*fakeSpare, string], waits chan time.Duration, tick chan time.Time) {
	waits, tick = make(chan time.Duration, 100), make(chan time.Time)
	cfg := f.config(1)
	cfg.AfterTake = time.Minute
	cfg.After = func(d time.Duration) <-chan time.Time {
		waits <- d
		return tick
	}
	p = startPool(t, cfg)
	eventually(t, "a full pool", p.Full)
	wait(t, "a spare", f.opens)
	return p, waits, tick
}

func TestAReturnedSpareIsIdleAgainAndItsNextAnswerGoesToItsNextTaker(t *testing.T) {
	f := newFarEnd()
	p, _, _ := heldPool(t, f)
	s := p.Take()
	s.Conn().answers <- "first"
	got := make(chan string, 1)
	s.OnAnswer(func(a string) { got <- a })
	if a := wait(t, "the first answer", got); a != "first" {
		t.Fatalf("the taker got %q", a)
	}
	p.Return(s)
	eventually(t, "the returned spare to be idle", p.Full)
	again := p.Take()
	if again == nil || again.Conn() != s.Conn() {
		t.Fatalf("took %v, want the returned connection", again)
	}
	again.Conn().answers <- "second"
	again.OnAnswer(func(a string) { got <- a })
	if a := wait(t, "the second answer", got); a != "second" {
		t.Fatalf("the second taker got %q", a)
	}
	again.Conn().end()
	if n := f.count(); n != 1 {
		t.Errorf("%d spares opened, want the one", n)
	}
}

func TestASpareReturnedWithinAfterTakeIsNotReplaced(t *testing.T) {
	f := newFarEnd()
	p, waits, tick := heldPool(t, f)
	s := p.Take()
	s.OnAnswer(nil)
	wait(t, "the wait after the take", waits)
	p.Return(s)
	tick <- time.Time{}
	// A second take makes the pool wait again, which it does only once it
	// has decided about the first: by then it would have opened a spare.
	s = p.Take()
	s.OnAnswer(nil)
	defer s.Conn().end()
	wait(t, "the wait after the second take", waits)
	if n := f.count(); n != 1 {
		t.Fatalf("%d spares opened, want none in place of the one returned in time", n)
	}
}

func TestAReturnToAFullOrClosedPoolClosesTheConnection(t *testing.T) {
	f := newFarEnd()
	p := startPool(t, f.config(1))
	eventually(t, "a full pool", p.Full)
	s := p.Take()
	s.OnAnswer(nil)
	// AfterTake is zero: the taken spare is replaced at once.
	wait(t, "a spare", f.opens)
	wait(t, "the replacement", f.opens)
	eventually(t, "a full pool again", p.Full)
	p.Return(s)
	if !s.Conn().closed.Load() {
		t.Error("a spare returned to a full pool was not closed")
	}

	// Close waits for the taken spare's watcher, which its return frees.
	s = p.Take()
	s.OnAnswer(nil)
	closed := make(chan struct{})
	go func() {
		p.Close()
		close(closed)
	}()
	eventually(t, "the pool to close", func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.closed
	})
	p.Return(s)
	if !s.Conn().closed.Load() {
		t.Error("a spare returned to a closed pool was not closed")
	}
	wait(t, "the pool's Close", closed)
}

func TestASpareTheFarEndTakesIsServedAndComesBackWhenReturned(t *testing.T) {
	f := newFarEnd()
	served := make(chan *Spare[*fakeSpare, string], 1)
	cfg := f.config(1)
	cfg.Taken = func(a string) bool { return a == "order" }
	cfg.Serve = func(_ *Spares[*fakeSpare, string], s *Spare[*fakeSpare, string], a string) { served <- s }
	p := startPool(t, cfg)
	eventually(t, "a full pool", p.Full)
	first := wait(t, "a spare", f.opens)

	first.answers <- "order"
	s := wait(t, "the far end's take served", served)
	if s.Conn() != first {
		t.Fatal("Serve got another spare than the one the far end took")
	}
	// Taken, it is replaced as a spare the pool's user took would be.
	wait(t, "the taken spare's replacement", f.opens)
	eventually(t, "a full pool again", p.Full)
	p.Return(s)
	if !first.closed.Load() {
		t.Error("a spare returned to a full pool was not closed")
	}

	// Any other answer while idle is a loss, as before.
	second := p.Take()
	second.OnAnswer(nil)
	defer second.Conn().end()
	third := wait(t, "the second's replacement", f.opens)
	third.answers <- "refused"
	if a := wait(t, "Lost", f.lost); a != "refused" {
		t.Errorf("Lost heard %q, want the far end's answer", a)
	}
}
