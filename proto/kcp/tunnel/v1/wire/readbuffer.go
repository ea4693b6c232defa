package wire

import (
	"encoding/binary"
	"io"
	"sync"

	"google.golang.org/grpc/mem"
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
	// large says that reads go into a pooled buffer: big, or a new one
	// if ReadFrame handed big to a frame.
	large bool
}

// Read reads from r once. The bytes it returns are valid until the next
// Read or Release.
func (b *ReadBuffer) Read(r io.Reader) ([]byte, error) {
	buf := b.small[:]
	if b.large {
		if b.big == nil {
			b.big = bigReads.Get().(*[]byte)
		}
		buf = *b.big
	}
	n, err := r.Read(buf)
	data := buf[:n]
	switch {
	case !b.large && n == len(buf):
		b.big, b.large = bigReads.Get().(*[]byte), true
	case b.large && n < smallRead && n > 0:
		// Small again: the bytes move to the small buffer, and the big
		// one goes back to the pool.
		data = append(b.small[:0], data...)
		b.Release()
	}
	return data, err
}

// ReadFrame is Read, with what it read as a data frame that owns its
// bytes: a read into the pooled buffer hands that buffer over to the frame,
// whose Free (or gRPC's, once it has sent the frame) returns it to the
// pool, and the next read takes another; a small read is copied. So a large
// transfer is forwarded without a copy or an allocation of its bytes. An
// empty read is an empty Frame.
func (b *ReadBuffer) ReadFrame(r io.Reader) (Frame, error) {
	data, err := b.Read(r)
	if len(data) == 0 {
		return Frame{}, err
	}
	if b.big == nil || &(*b.big)[0] != &data[0] {
		return NewDataFrame(data), err
	}
	payload := b.big
	b.big = nil
	*payload = data
	return dataFrame(mem.NewBuffer(payload, readPool{})), err
}

// Release returns the pooled buffer, if any.
func (b *ReadBuffer) Release() {
	if b.big != nil {
		bigReads.Put(b.big)
		b.big = nil
	}
	b.large = false
}

// readPool is bigReads as gRPC's buffer pool, for the buffers ReadFrame
// hands to frames.
type readPool struct{}

func (readPool) Get(length int) *[]byte {
	b := bigReads.Get().(*[]byte)
	if cap(*b) < length {
		nb := make([]byte, length)
		return &nb
	}
	*b = (*b)[:length]
	return b
}

func (readPool) Put(b *[]byte) {
	if cap(*b) != MaxFrame {
		return
	}
	*b = (*b)[:MaxFrame]
	bigReads.Put(b)
}

// dataFrame is a data frame of payload, which it owns: its encoding's
// prefix in a small buffer of its own, then payload as it is.
func dataFrame(payload mem.Buffer) Frame {
	head := make([]byte, 1, 1+binary.MaxVarintLen64)
	head[0] = dataTag
	head = binary.AppendUvarint(head, uint64(payload.Len()))
	return Frame{buf: mem.BufferSlice{mem.SliceBuffer(head), payload}}
}
