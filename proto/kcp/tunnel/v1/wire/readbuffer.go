package wire

import (
	"io"
	"sync"
)

// smallRead is the buffer a ReadBuffer reads into while what arrives is
// small: a webhook's request or answer, a TLS handshake message.
const smallRead = 2 << 10

var bigReads = sync.Pool{New: func() any { b := make([]byte, MaxFrame); return &b }}

// ReadBuffer is the buffer of one connection's reads, sized for what the
// connection carries. A goroutine blocked in Read holds its buffer for as
// long as the peer is silent, so an idle tunnel should hold a small one: it
// reads into 2 KiB of its own until a read fills them, and then into a
// pooled MaxFrame buffer until a read brings what 2 KiB would have held.
// The zero value is ready; Release returns the pooled buffer.
type ReadBuffer struct {
	small [smallRead]byte
	big   *[]byte
}

// Read reads from r once. The bytes it returns are valid until the next
// Read or Release.
func (b *ReadBuffer) Read(r io.Reader) ([]byte, error) {
	buf := b.small[:]
	if b.big != nil {
		buf = *b.big
	}
	n, err := r.Read(buf)
	data := buf[:n]
	switch {
	case b.big == nil && n == len(buf):
		b.big = bigReads.Get().(*[]byte)
	case b.big != nil && n < smallRead && n > 0:
		// Small again: the bytes move to the small buffer, and the big
		// one goes back to the pool.
		data = append(b.small[:0], data...)
		b.Release()
	}
	return data, err
}

// Release returns the pooled buffer, if any.
func (b *ReadBuffer) Release() {
	if b.big != nil {
		bigReads.Put(b.big)
		b.big = nil
	}
}
