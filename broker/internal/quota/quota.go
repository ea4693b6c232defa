// Package quota counts what each SPIFFE ID holds against a limit, and what
// all of them hold against another.
package quota

import (
	"sync"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
)

// Quota bounds what one SPIFFE ID may hold at once, and optionally what all
// IDs together may. A limit of 0 or less means none. The zero Quota admits
// anything.
type Quota struct {
	PerID int64
	Total int64

	mu    sync.Mutex
	held  map[spiffeid.ID]int64 // only IDs that hold something: the map stays as small as what is held
	total int64
}

// Over says which limit refused a Take.
type Over int

const (
	// Under: taken.
	Under Over = iota
	// OverPerID: the ID holds PerID already.
	OverPerID
	// OverTotal: all IDs together hold Total already.
	OverTotal
)

// Take takes one for id unless a limit is reached. On Under, release gives it
// back; it may be called more than once, and counts once.
func (q *Quota) Take(id spiffeid.ID) (release func(), over Over) {
	return q.TakeN(id, 1)
}

// TakeN takes n for id (bytes, say) unless that would put id past PerID or
// all IDs past Total. On Under, release gives them back; it may be called
// more than once, and counts once.
func (q *Quota) TakeN(id spiffeid.ID, n int64) (release func(), over Over) {
	q.mu.Lock()
	defer q.mu.Unlock()
	switch {
	case q.PerID > 0 && q.held[id]+n > q.PerID:
		return nil, OverPerID
	case q.Total > 0 && q.total+n > q.Total:
		return nil, OverTotal
	}
	if q.held == nil {
		q.held = map[spiffeid.ID]int64{}
	}
	q.held[id] += n
	q.total += n
	return sync.OnceFunc(func() { q.release(id, n) }), Under
}

func (q *Quota) release(id spiffeid.ID, n int64) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.total -= n
	if q.held[id] -= n; q.held[id] <= 0 {
		delete(q.held, id)
	}
}

// Held is what id holds now.
func (q *Quota) Held(id spiffeid.ID) int64 {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.held[id]
}

// TotalHeld is what all IDs hold now.
func (q *Quota) TotalHeld() int64 {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.total
}
