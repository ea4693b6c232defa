package identity

import (
	"container/list"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/credentials"
)

// stalledAfter is how long a handshake may last before a new one may take
// its place when every slot is taken. A handshake takes a few round trips,
// milliseconds; one still going after a second is most likely a peer that
// stalls on purpose.
const stalledAfter = time.Second

var (
	errOverLimit = errors.New("too many TLS handshakes in progress")
	errEvicted   = errors.New("too many TLS handshakes in progress: this one, the oldest, made room for a new one")
)

// handshakeSlots bounds the server's handshakes in progress. Past the bound
// the oldest handshake is dropped if it has stalled, so that peers that
// open connections and send nothing cannot hold every slot and lock
// everyone else out; if none has stalled, the new connection is closed at
// once and its client retries later. Either way memory and file
// descriptors spent on handshakes stay bounded.
type handshakeSlots struct {
	max int
	now func() time.Time // time.Now, except in tests

	mu         sync.Mutex
	inProgress list.List // of *slot, oldest first
}

type slot struct {
	conn    net.Conn
	started time.Time
	elem    *list.Element // nil once released or evicted
	evicted atomic.Bool
}

func newHandshakeSlots(max int) *handshakeSlots {
	return &handshakeSlots{max: max, now: time.Now}
}

// acquire takes a slot for a handshake on conn, perhaps dropping a stalled
// one (whose connection it closes).
func (h *handshakeSlots) acquire(conn net.Conn) (*slot, error) {
	h.mu.Lock()
	now := h.now()
	var victim *slot
	if h.inProgress.Len() >= h.max {
		oldest := h.inProgress.Front().Value.(*slot)
		if now.Sub(oldest.started) < stalledAfter {
			h.mu.Unlock()
			return nil, refused(ReasonOverLimit, errOverLimit)
		}
		h.inProgress.Remove(oldest.elem)
		oldest.elem = nil
		victim = oldest
	}
	s := &slot{conn: conn, started: now}
	s.elem = h.inProgress.PushBack(s)
	h.mu.Unlock()
	if victim != nil {
		victim.evicted.Store(true)
		// Its handshake fails at once and releases nothing more.
		victim.conn.Close()
	}
	return s, nil
}

// release frees the slot of a finished handshake.
func (h *handshakeSlots) release(s *slot) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if s.elem != nil {
		h.inProgress.Remove(s.elem)
		s.elem = nil
	}
}

// inUse is the number of handshakes in progress.
func (h *handshakeSlots) inUse() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.inProgress.Len()
}

// boundHandshakes runs each of creds' server handshakes in one of slots.
// A client's handshakes are not bounded: it opens its connections itself.
func boundHandshakes(creds credentials.TransportCredentials, slots *handshakeSlots) credentials.TransportCredentials {
	return &slottedCreds{TransportCredentials: creds, slots: slots}
}

type slottedCreds struct {
	credentials.TransportCredentials
	slots *handshakeSlots
}

func (c *slottedCreds) ServerHandshake(raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	s, err := c.slots.acquire(raw)
	if err != nil {
		return nil, nil, err
	}
	defer c.slots.release(s)
	conn, info, err := c.TransportCredentials.ServerHandshake(raw)
	if err != nil && s.evicted.Load() {
		// It failed because its connection was closed to make room: say
		// so rather than how the closed connection broke it.
		return nil, nil, refused(ReasonOverLimit, errEvicted)
	}
	return conn, info, err
}

// Clone shares the slots: the bound is the listener's, whichever copy of
// its credentials a connection went through.
func (c *slottedCreds) Clone() credentials.TransportCredentials {
	return &slottedCreds{TransportCredentials: c.TransportCredentials.Clone(), slots: c.slots}
}
