package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"google.golang.org/protobuf/proto"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// Once the broker has answered a data or dial connection's open or dial
// with OK, the tunnel goes in frames (docs/protocol.md §3.7): its bytes in
// data frames, each direction's half-close as a close_write, and one end
// from each side, after which the connection is idle and carries the next
// tunnel. Each frame is one field of a ConnFrame: its tag, its length as a
// varint, its payload. A data frame's bytes are those of a data frame on a
// stream (Frame), so the broker passes frames between the two as they are.

const (
	closeWriteTag = 3<<3 | 2
	endTag        = 4<<3 | 2
	// maxFrameHead is a frame's tag and the varint of a length up to
	// MaxFrame (under 2^21): the room ReadBuffer keeps before a payload.
	maxFrameHead = 4
)

// The bounds of the end exchange: a side that has sent its end waits at
// most EndTimeout for the other's, and reads and drops at most EndDrain
// bytes of the tunnel's data meanwhile (what was in flight when the other
// side learnt of the end). Past either, it closes the connection instead
// of carrying another tunnel on it.
const (
	EndTimeout = time.Second
	EndDrain   = 1 << 20
)

// FrameKind is what a frame is.
type FrameKind int

const (
	FrameData FrameKind = iota + 1
	FrameCloseWrite
	FrameEnd
)

// ErrBadFrame is a frame the protocol does not allow: an unknown tag, an
// empty or oversized data frame, a close_write with a payload, an end too
// large or that does not decode.
var ErrBadFrame = errors.New("protocol error: not a valid frame")

// FrameReader reads a connection's frames. Its reads may be cut short
// (a read deadline) anywhere and resumed: it keeps a header or an end read
// in part, and how much of a data frame's payload is unread. The zero
// value is ready.
type FrameReader struct {
	head    [maxFrameHead]byte
	headLen int
	unread  int    // of the current data frame's payload
	end     []byte // an end's payload, while it is read
	endRead int
}

// Unread is the current data frame's payload not read yet: Read it (or
// Discard it) before the next frame.
func (r *FrameReader) Unread() int { return r.unread }

// Next reads the next frame's header, and an end's payload: for FrameData,
// Unread is its payload's length; for FrameEnd, end is the status it ended
// the tunnel with (nil: OK). A frame the protocol does not allow is an
// error wrapping ErrBadFrame. A tunnel ends with an end frame, never with
// its connection, so a connection that ends, even between two frames, is
// io.ErrUnexpectedEOF (crypto/tls reads a socket closed without a
// close_notify there as io.EOF); its other errors are returned as they
// are. Call it only once the current data frame is read.
func (r *FrameReader) Next(src io.Reader) (kind FrameKind, end error, err error) {
	if r.unread > 0 {
		return 0, nil, errors.New("wire: Next before the data frame was read")
	}
	if r.end == nil {
		n, err := r.readHead(src)
		if err != nil {
			return 0, nil, err
		}
		switch r.head[0] {
		case dataTag:
			if n == 0 || n > MaxFrame {
				return 0, nil, fmt.Errorf("%w: a data frame of %d bytes, where 1 to %d may be", ErrBadFrame, n, MaxFrame)
			}
			r.unread = n
			return FrameData, nil, nil
		case closeWriteTag:
			if n != 0 {
				return 0, nil, fmt.Errorf("%w: a close_write of %d bytes", ErrBadFrame, n)
			}
			return FrameCloseWrite, nil, nil
		case endTag:
			if n > maxOpenResult {
				return 0, nil, fmt.Errorf("%w: an end of %d bytes, where at most %d may be", ErrBadFrame, n, maxOpenResult)
			}
			r.end, r.endRead = make([]byte, n), 0
		default:
			return 0, nil, fmt.Errorf("%w: tag %#x", ErrBadFrame, r.head[0])
		}
	}
	for r.endRead < len(r.end) {
		m, err := src.Read(r.end[r.endRead:])
		r.endRead += m
		if err != nil && r.endRead < len(r.end) {
			return 0, nil, unexpected(err)
		}
	}
	var res tunnelv1.OpenResult
	err = proto.Unmarshal(r.end, &res)
	r.end = nil
	if err != nil {
		return 0, nil, fmt.Errorf("%w: an end that does not decode: %v", ErrBadFrame, err)
	}
	if res.GetCode() != int32(codes.OK) {
		end = status.Error(codes.Code(res.GetCode()), res.GetMessage())
	}
	return FrameEnd, end, nil
}

// readHead reads a frame's tag and length a byte at a time, so that
// nothing past the header is read, and returns the length.
func (r *FrameReader) readHead(src io.Reader) (int, error) {
	for {
		if r.headLen >= 2 && r.head[r.headLen-1] < 0x80 {
			n, _ := binary.Uvarint(r.head[1:r.headLen])
			r.headLen = 0
			return int(n), nil
		}
		if r.headLen == len(r.head) {
			r.headLen = 0
			return 0, fmt.Errorf("%w: a length over %d", ErrBadFrame, MaxFrame)
		}
		m, err := src.Read(r.head[r.headLen : r.headLen+1])
		r.headLen += m
		if m == 0 && err != nil {
			return 0, unexpected(err)
		}
	}
}

// Read reads the current data frame's payload into p: at most Unread
// bytes. A connection that ends is io.ErrUnexpectedEOF, as in Next, even
// with the frame's last bytes (crypto/tls returns a record's last bytes
// with io.EOF when a close_notify follows it).
func (r *FrameReader) Read(src io.Reader, p []byte) (int, error) {
	if r.unread == 0 {
		return 0, nil
	}
	n, err := src.Read(p[:min(len(p), r.unread)])
	r.unread -= n
	return n, unexpected(err)
}

// unexpected is io.ErrUnexpectedEOF for a connection that ended inside a
// frame, and err otherwise.
func unexpected(err error) error {
	if err == io.EOF {
		return io.ErrUnexpectedEOF
	}
	return err
}

// AppendData appends a data frame of payload (1 to MaxFrame bytes) to buf.
func AppendData(buf, payload []byte) []byte {
	buf = append(buf, dataTag)
	buf = binary.AppendUvarint(buf, uint64(len(payload)))
	return append(buf, payload...)
}

// WriteCloseWrite writes a close_write frame.
func WriteCloseWrite(w io.Writer) error {
	_, err := w.Write([]byte{closeWriteTag, 0})
	return err
}

// WriteEnd writes an end frame with err's status (nil: OK), its message
// cut to fit.
func WriteEnd(w io.Writer, err error) error {
	buf, err := appendDelimited([]byte{endTag}, resultOf(&tunnelv1.OpenResult{}, err))
	if err != nil {
		return err
	}
	_, err = w.Write(buf)
	return err
}
