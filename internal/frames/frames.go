// Package frames lets the broker forward data frames between the caller's
// and the agent's streams without decoding and re-encoding them.
//
// A data frame is field 2 (bytes) of DialRequest, DialResponse, TunnelRequest
// and TunnelResponse alike (docs/protocol.md §2), so its wire bytes,
// 0x12 varint(n) payload, are the same on both legs. The codec below keeps a
// received Frame in gRPC's pooled buffers and hands the very same buffers to
// the other stream's Send: no unmarshalling, no copy, no allocation per
// frame. Every other message goes through the ordinary proto codec.
package frames

import (
	"encoding/binary"
	"errors"

	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
)

// Frame is one message kept in its wire encoding.
type Frame struct {
	buf mem.BufferSlice
}

// dataTag is field 2, wire type 2 (length-delimited).
const dataTag = 2<<3 | 2

var errNotData = errors.New("not a non-empty data frame")

// DataLen checks that f is a data frame and nothing else, and returns its
// payload's length.
func (f *Frame) DataLen() (int, error) {
	var head [1 + binary.MaxVarintLen64]byte
	n := copyPrefix(head[:], f.buf)
	if n < 2 || head[0] != dataTag {
		return 0, errNotData
	}
	size, m := binary.Uvarint(head[1:n])
	if m <= 0 || size == 0 || uint64(f.buf.Len()-1-m) != size {
		return 0, errNotData
	}
	return int(size), nil
}

// Free releases the frame's buffers if it is not going to be sent.
func (f *Frame) Free() {
	f.buf.Free()
	f.buf = nil
}

// copyPrefix copies the first bytes of bs into dst.
func copyPrefix(dst []byte, bs mem.BufferSlice) int {
	n := 0
	for _, b := range bs {
		n += copy(dst[n:], b.ReadOnlyData())
		if n == len(dst) {
			break
		}
	}
	return n
}

// codec passes Frames through and encodes everything else as proto.
type codec struct {
	proto encoding.CodecV2
}

// Marshal implements encoding.CodecV2. A Frame's buffers pass to gRPC, which
// frees them once written.
func (c codec) Marshal(v any) (mem.BufferSlice, error) {
	if f, ok := v.(*Frame); ok {
		b := f.buf
		f.buf = nil
		return b, nil
	}
	return c.proto.Marshal(v)
}

// Unmarshal implements encoding.CodecV2. A Frame keeps a reference to the
// received buffers, which gRPC would otherwise reuse.
func (c codec) Unmarshal(data mem.BufferSlice, v any) error {
	if f, ok := v.(*Frame); ok {
		data.Ref()
		f.buf = data
		return nil
	}
	return c.proto.Unmarshal(data, v)
}

// Name implements encoding.CodecV2: it is the proto codec on the wire.
func (c codec) Name() string { return proto.Name }

// ServerOption makes a gRPC server able to receive and send Frames.
func ServerOption() grpc.ServerOption {
	return grpc.ForceServerCodecV2(codec{proto: encoding.GetCodecV2(proto.Name)})
}
