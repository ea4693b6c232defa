package fragments

import (
	"encoding/binary"

	"golang.org/x/net/http2"
)

// frameHeaderLen is the length of every HTTP/2 frame header: a 24-bit
// payload length, the type, the flags and a 31-bit stream id.
const frameHeaderLen = 9

// scanner follows the HTTP/2 frames in one direction of a connection as its
// bytes go by, however they are cut: it reads the frame headers and skips
// the payloads, without copying them. For each DATA frame it calls dataFrame
// once, with what the frame carries.
type scanner struct {
	// skip is how many bytes before the first frame are still to pass
	// (the client's connection preface).
	skip int
	// head holds the bytes of the next frame header seen so far.
	head    [frameHeaderLen]byte
	headLen int
	// rest is how many bytes of the current frame's payload are still to
	// pass.
	rest uint32
	// padLenNext says the current frame is a padded DATA frame whose next
	// payload byte, its pad length, is still to come; frame is its header.
	padLenNext bool
	frame      http2.FrameHeader
	// lastStream is the highest stream a HEADERS frame opened.
	lastStream uint32
	// dataFrame, if set, is called once per DATA frame with its header
	// (whose Length counts the padding too) and how many bytes of data it
	// carries.
	dataFrame func(f http2.FrameHeader, data uint32)
}

// newServerScanner follows what a client sends: its preface, then frames.
func newServerScanner(dataFrame func(f http2.FrameHeader, data uint32)) *scanner {
	return &scanner{skip: len(http2.ClientPreface), dataFrame: dataFrame}
}

// scan follows p, the next bytes of the connection.
func (s *scanner) scan(p []byte) {
	for len(p) > 0 {
		switch {
		case s.skip > 0:
			n := min(s.skip, len(p))
			s.skip -= n
			p = p[n:]
		case s.rest > 0:
			if s.padLenNext {
				s.padLenNext = false
				s.padded(p[0])
			}
			n := min(s.rest, uint32(len(p)))
			s.rest -= n
			p = p[n:]
		default:
			n := copy(s.head[s.headLen:], p)
			s.headLen += n
			p = p[n:]
			if s.headLen == frameHeaderLen {
				s.headLen = 0
				s.header()
			}
		}
	}
}

// atFrameStart says whether the bytes so far end with a whole frame.
func (s *scanner) atFrameStart() bool {
	return s.skip == 0 && s.headLen == 0 && s.rest == 0
}

// header reads a whole frame header.
func (s *scanner) header() {
	h := s.head
	f := http2.FrameHeader{
		Type:     http2.FrameType(h[3]),
		Flags:    http2.Flags(h[4]),
		Length:   uint32(h[0])<<16 | uint32(h[1])<<8 | uint32(h[2]),
		StreamID: binary.BigEndian.Uint32(h[5:]) & (1<<31 - 1),
	}
	s.rest = f.Length
	switch {
	case f.Type == http2.FrameHeaders:
		s.lastStream = max(s.lastStream, f.StreamID)
	case f.Type != http2.FrameData || s.dataFrame == nil:
	case f.Flags.Has(http2.FlagDataPadded) && f.Length > 0:
		// How much is data, its first payload byte says.
		s.padLenNext, s.frame = true, f
	case f.Flags.Has(http2.FlagDataPadded):
		// Too short to say its pad length: gRPC closes the connection.
		s.dataFrame(f, 0)
	default:
		s.dataFrame(f, f.Length)
	}
}

// padded reads the pad length of the current DATA frame.
func (s *scanner) padded(padLen byte) {
	var data uint32
	if 1+uint32(padLen) <= s.frame.Length {
		data = s.frame.Length - 1 - uint32(padLen)
	} // else more padding than payload: gRPC closes the connection.
	s.dataFrame(s.frame, data)
}
