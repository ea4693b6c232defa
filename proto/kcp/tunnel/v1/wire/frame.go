package wire

import (
	"encoding/binary"
	"errors"
	"io"
	"net"

	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	protocodec "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
)

// Frame is a received message kept in its wire encoding, in gRPC's pooled
// buffers, so that data can be forwarded or read without decoding the
// message and copying its bytes. Receive one with RecvMsg(&frame) on a
// stream that uses FrameCodec.
//
// A data frame is field 2 of DialRequest, DialResponse, TunnelRequest and
// TunnelResponse alike, so its bytes (0x12 varint(n) payload) are the same
// on both legs: the broker sends a received Frame on as it is. Every other
// message is decoded with Decode.
type Frame struct {
	buf mem.BufferSlice
	off int // start of the unread payload, for Read
	end int // end of the payload
}

// dataTag is field 2, wire type 2 (length-delimited).
const dataTag = 2<<3 | 2

// ErrNotData is returned for a frame that is not non-empty data.
var ErrNotData = errors.New("not a non-empty data frame")

// DataLen checks that f is a data frame and nothing else, and returns the
// length of its payload.
func (f *Frame) DataLen() (int, error) {
	var head [1 + binary.MaxVarintLen64]byte
	n := copyPrefix(head[:], f.buf)
	if n < 2 || head[0] != dataTag {
		return 0, ErrNotData
	}
	size, m := binary.Uvarint(head[1:n])
	if m <= 0 || size == 0 || uint64(f.buf.Len()-1-m) != size {
		return 0, ErrNotData
	}
	if f.end == 0 {
		f.off, f.end = 1+m, f.buf.Len()
	}
	return int(size), nil
}

// NewDataFrame is a data frame that carries a copy of payload (not empty),
// encoded as every sender encodes data: for a sender that reads its bytes
// from elsewhere than a gRPC stream, such as the broker's CONNECT front end.
func NewDataFrame(payload []byte) Frame {
	b := make([]byte, 1+binary.MaxVarintLen64+len(payload))
	b[0] = dataTag
	m := binary.PutUvarint(b[1:], uint64(len(payload)))
	n := 1 + m + copy(b[1+m:], payload)
	return Frame{buf: mem.BufferSlice{mem.SliceBuffer(b[:n])}, off: 1 + m, end: n}
}

// NewFrame is the frame of a message's wire encoding in encoded, whose
// buffers it takes: for a sender that encodes a data frame in place, in a
// buffer it reads into (the broker's and the agent's connections).
func NewFrame(encoded mem.BufferSlice) Frame { return Frame{buf: encoded} }

// Empty says that f holds nothing: the zero Frame.
func (f *Frame) Empty() bool { return f.buf.Len() == 0 }

// Decode decodes f into m, for frames that are not data.
func (f *Frame) Decode(m proto.Message) error {
	return proto.Unmarshal(f.buf.Materialize(), m)
}

// Read reads the payload of a data frame (call DataLen first).
func (f *Frame) Read(p []byte) (int, error) {
	if f.off >= f.end {
		return 0, io.EOF
	}
	n, pos := 0, 0
	for _, b := range f.buf {
		data := b.ReadOnlyData()
		if f.off < pos+len(data) {
			c := copy(p[n:], data[f.off-pos:])
			n += c
			f.off += c
			if n == len(p) {
				break
			}
		}
		pos += len(data)
	}
	return n, nil
}

// Unread is the payload not read yet.
func (f *Frame) Unread() int { return f.end - f.off }

// WriteTo writes the payload of a data frame to w in one vectored write
// where w allows it (call DataLen first).
func (f *Frame) WriteTo(w io.Writer) (int64, error) {
	if len(f.buf) == 1 {
		// One buffer (a small frame, or one read into a whole buffer): a
		// plain write, without a net.Buffers to allocate.
		data := f.buf[0].ReadOnlyData()
		if f.off >= len(data) {
			return 0, nil
		}
		n, err := w.Write(data[f.off:])
		f.off += n
		return int64(n), err
	}
	var bufs net.Buffers
	pos := 0
	for _, b := range f.buf {
		data := b.ReadOnlyData()
		if start := f.off - pos; start < len(data) {
			bufs = append(bufs, data[max(start, 0):])
		}
		pos += len(data)
	}
	n, err := bufs.WriteTo(w)
	f.off += int(n)
	return n, err
}

// Free releases the frame's buffers once it is read, or if it is not going
// to be sent.
func (f *Frame) Free() {
	f.buf.Free()
	*f = Frame{}
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

// frameCodec passes Frames through and encodes everything else as proto.
type frameCodec struct {
	proto encoding.CodecV2
}

// FrameCodec is the proto codec, plus Frames: a Frame received keeps a
// reference to gRPC's buffers, and a Frame sent hands them back to gRPC,
// which frees them once written. On the wire it is the proto codec.
func FrameCodec() encoding.CodecV2 {
	return frameCodec{proto: encoding.GetCodecV2(protocodec.Name)}
}

func (c frameCodec) Marshal(v any) (mem.BufferSlice, error) {
	if f, ok := v.(*Frame); ok {
		b := f.buf
		*f = Frame{}
		return b, nil
	}
	return c.proto.Marshal(v)
}

func (c frameCodec) Unmarshal(data mem.BufferSlice, v any) error {
	if f, ok := v.(*Frame); ok {
		data.Ref()
		*f = Frame{buf: data}
		return nil
	}
	return c.proto.Unmarshal(data, v)
}

func (c frameCodec) Name() string { return protocodec.Name }

// FrameServerOption makes a server's streams able to receive and send Frames.
func FrameServerOption() grpc.ServerOption { return grpc.ForceServerCodecV2(FrameCodec()) }

// FrameCallOption makes one call's stream able to receive Frames, leaving
// the connection's other calls alone.
func FrameCallOption() grpc.CallOption { return grpc.ForceCodecV2(FrameCodec()) }
