package splice

import (
	"io"
	"sync"

	"google.golang.org/grpc/mem"

	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// smallRead is the buffer a ReadBuffer reads into while what arrives is
// small: a webhook's request or answer, a TLS handshake message.
const smallRead = 2 << 10

// dataTag begins a data frame: field 2 (data) of every request and
// response, length-delimited.
const dataTag = 2<<3 | 2

// maxFrameHead is the room for a data frame's head before its payload: its
// tag and its length as a 3-byte varint (wire.MaxFrame < 1<<21).
const maxFrameHead = 4

// bigReads are the pooled buffers of large reads: wire.MaxFrame bytes, after
// the room for a frame's head, so that a frame made of a read is its
// encoding in one piece, which gRPC sends on without a copy.
var bigReads = sync.Pool{New: func() any { b := make([]byte, maxFrameHead+wire.MaxFrame); return &b }}

// ReadBuffer is the buffer of one connection's reads, sized for what the
// connection carries. A goroutine blocked in Read holds its buffer for as
// long as the peer is silent, so an idle tunnel should hold a small one: it
// reads into 2 KiB of its own until a read fills them, and then into a
// pooled wire.MaxFrame buffer until a read brings what 2 KiB would have held.
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
	n, err := r.Read(b.next())
	return b.took(n), err
}

// next is the buffer the next read goes into.
func (b *ReadBuffer) next() []byte {
	if !b.large {
		return b.small[:]
	}
	if b.big == nil {
		b.big = bigReads.Get().(*[]byte)
	}
	return (*b.big)[maxFrameHead:]
}

// took is what a read of n bytes into next brought, and sizes the buffer
// of the reads after it.
func (b *ReadBuffer) took(n int) []byte {
	if !b.large {
		if n == smallRead {
			b.big, b.large = bigReads.Get().(*[]byte), true
		}
		return b.small[:n]
	}
	data := (*b.big)[maxFrameHead : maxFrameHead+n]
	if n < smallRead && n > 0 {
		// Small again: the bytes move to the small buffer, and the big
		// one goes back to the pool.
		data = append(b.small[:0], data...)
		b.Release()
	}
	return data
}

// ReadFrame is Read, with what it read as a data frame that owns its
// bytes: a read into the pooled buffer hands that buffer over to the frame,
// whose Free (or gRPC's, once it has sent the frame) returns it to the
// pool, and the next read takes another; a small read is copied. So a large
// transfer is forwarded without a copy or an allocation of its bytes. An
// empty read is an empty Frame.
func (b *ReadBuffer) ReadFrame(r io.Reader) (wire.Frame, error) {
	data, err := b.Read(r)
	return b.frame(data), err
}

// frame is data, just read, as a data frame that owns its bytes.
func (b *ReadBuffer) frame(data []byte) wire.Frame {
	if len(data) == 0 {
		return wire.Frame{}
	}
	if b.big == nil || &(*b.big)[maxFrameHead] != &data[0] {
		return wire.NewDataFrame(data)
	}
	buf := b.big
	b.big = nil
	// The head goes in the room before the payload, its length as a
	// varint of three bytes however small (protobuf reads a varint with
	// more bytes than it needs as well), so that it ends where the
	// payload starts.
	head := (*buf)[:maxFrameHead]
	n := len(data)
	head[0], head[1], head[2], head[3] = dataTag, byte(n)|0x80, byte(n>>7)|0x80, byte(n>>14)
	*buf = (*buf)[:maxFrameHead+n]
	return wire.NewFrame(mem.BufferSlice{mem.NewBuffer(buf, readPool{})})
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
	if cap(*b) != maxFrameHead+wire.MaxFrame {
		return
	}
	*b = (*b)[:cap(*b)]
	bigReads.Put(b)
}
