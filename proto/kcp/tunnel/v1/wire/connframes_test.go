package wire

import (
	"bytes"
	"errors"
	"io"
	"os"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// stingy hands out one byte a Read, and a deadline's error before every
// other byte, as a connection read by a splice its tunnel's end cut short.
type stingy struct {
	data []byte
	cut  bool
}

func (s *stingy) Read(p []byte) (int, error) {
	if s.cut = !s.cut; s.cut {
		return 0, os.ErrDeadlineExceeded
	}
	if len(s.data) == 0 {
		return 0, io.EOF
	}
	p[0] = s.data[0]
	s.data = s.data[1:]
	return 1, nil
}

// readAll reads every frame of src as FrameReader's user would, retrying
// reads a deadline cut short, and describes each.
func readAll(t *testing.T, src io.Reader) []string {
	t.Helper()
	var r FrameReader
	var got []string
	for {
		kind, end, err := r.Next(src)
		if errors.Is(err, os.ErrDeadlineExceeded) {
			continue
		}
		if err == io.ErrUnexpectedEOF {
			return got
		}
		if err != nil {
			t.Fatalf("after %q: %v", got, err)
		}
		switch kind {
		case FrameData:
			var payload []byte
			for r.Unread() > 0 {
				p := make([]byte, 7)
				n, err := r.Read(src, p)
				payload = append(payload, p[:n]...)
				if err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
					t.Fatal(err)
				}
			}
			got = append(got, "data "+string(payload))
		case FrameCloseWrite:
			got = append(got, "close_write")
		case FrameEnd:
			got = append(got, "end "+status.Code(end).String()+" "+status.Convert(end).Message())
		}
	}
}

func TestFramesReadBackAsTheyWereWrittenWhereverAReadIsCutShort(t *testing.T) {
	var buf bytes.Buffer
	buf.Write(AppendData(nil, []byte("hello")))
	buf.Write(AppendData(nil, bytes.Repeat([]byte("x"), 300))) // a two-byte length
	if err := WriteCloseWrite(&buf); err != nil {
		t.Fatal(err)
	}
	if err := WriteEnd(&buf, status.Error(codes.Unavailable, "tunnel lost")); err != nil {
		t.Fatal(err)
	}
	if err := WriteEnd(&buf, nil); err != nil {
		t.Fatal(err)
	}
	got := readAll(t, &stingy{data: buf.Bytes()})
	want := []string{"data hello", "data " + strings.Repeat("x", 300), "close_write", "end Unavailable tunnel lost", "end OK "}
	if strings.Join(got, "|") != strings.Join(want, "|") {
		t.Fatalf("read %q, want %q", got, want)
	}
}

func TestEachFrameIsAConnFrameOfOneField(t *testing.T) {
	var buf bytes.Buffer
	buf.Write(AppendData(nil, []byte("hi")))
	cut := buf.Len()
	if err := WriteEnd(&buf, status.Error(codes.Canceled, "gone")); err != nil {
		t.Fatal(err)
	}
	var data, end tunnelv1.ConnFrame
	if err := proto.Unmarshal(buf.Bytes()[:cut], &data); err != nil || string(data.GetData()) != "hi" {
		t.Fatalf("a data frame decodes as %v, %v", &data, err)
	}
	if err := proto.Unmarshal(buf.Bytes()[cut:], &end); err != nil || end.GetEnd().GetCode() != int32(codes.Canceled) || end.GetEnd().GetMessage() != "gone" {
		t.Fatalf("an end decodes as %v, %v", &end, err)
	}
}

func TestAFrameTheProtocolDoesNotAllowIsErrBadFrame(t *testing.T) {
	bigEnd := append([]byte{endTag, 0x81, 0x04}, make([]byte, 513)...)
	for name, frame := range map[string][]byte{
		"an unknown tag":          {6<<3 | 2, 1, 'x'},
		"an empty data frame":     {dataTag, 0},
		"a data frame too large":  {dataTag, 0xf1, 0xff, 0x01},
		"a length of four bytes":  {dataTag, 0x80, 0x80, 0x80, 0x01},
		"a close_write with data": {closeWriteTag, 1, 'x'},
		"an end too large":        bigEnd,
		"an end that is not one":  {endTag, 2, 0xff, 0xff},
	} {
		t.Run(name, func(t *testing.T) {
			var r FrameReader
			_, _, err := r.Next(bytes.NewReader(frame))
			if !errors.Is(err, ErrBadFrame) {
				t.Fatalf("Next: %v, want ErrBadFrame", err)
			}
		})
	}
}

func TestAConnectionThatEndsBetweenOrInsideFramesIsUnexpectedEOF(t *testing.T) {
	var r FrameReader
	if _, _, err := r.Next(bytes.NewReader(nil)); err != io.ErrUnexpectedEOF {
		t.Fatalf("between frames: %v, want io.ErrUnexpectedEOF: only an end ends a tunnel", err)
	}
	if _, _, err := r.Next(bytes.NewReader([]byte{dataTag})); err != io.ErrUnexpectedEOF {
		t.Fatalf("inside a head: %v, want io.ErrUnexpectedEOF", err)
	}
	r = FrameReader{}
	src := bytes.NewReader([]byte{dataTag, 5, 'a'})
	if _, _, err := r.Next(src); err != nil {
		t.Fatal(err)
	}
	p := make([]byte, 5)
	n, err := r.Read(src, p)
	if n, err = r.Read(src, p[n:]); err != io.ErrUnexpectedEOF {
		t.Fatalf("inside a payload: %d, %v; want io.ErrUnexpectedEOF", n, err)
	}
}

func TestFramesOfLargeReadsAreOneBufferThatDecodesAsData(t *testing.T) {
	payload := bytes.Repeat([]byte("y"), 3*smallRead)
	src := bytes.NewReader(AppendData(nil, payload))
	var r FrameReader
	var b ReadBuffer
	defer b.Release()
	// The first read fills the small buffer; the next go to pooled ones.
	var got []byte
	if _, _, err := r.Next(src); err != nil {
		t.Fatal(err)
	}
	for r.Unread() > 0 {
		f, err := b.ReadData(src, &r)
		if err != nil {
			t.Fatal(err)
		}
		n, err := f.DataLen()
		if err != nil {
			t.Fatalf("a frame of ReadData: %v", err)
		}
		var out bytes.Buffer
		if _, err := f.WriteFrame(&out); err != nil {
			t.Fatal(err)
		}
		var cf tunnelv1.ConnFrame
		if err := proto.Unmarshal(out.Bytes(), &cf); err != nil || len(cf.GetData()) != n {
			t.Fatalf("the frame written decodes as %d bytes of data, %v; want %d", len(cf.GetData()), err, n)
		}
		got = append(got, cf.GetData()...)
		f.Free()
	}
	if !bytes.Equal(got, payload) {
		t.Fatal("the frames do not carry the payload")
	}
}

func TestAFrameInSeveralBuffersIsWrittenWithOneWrite(t *testing.T) {
	whole := AppendData(nil, []byte("split in three"))
	f := Frame{buf: mem.BufferSlice{mem.SliceBuffer(whole[:1]), mem.SliceBuffer(whole[1:6]), mem.SliceBuffer(whole[6:])}}
	var w countingWriter
	if _, err := f.WriteFrame(&w); err != nil {
		t.Fatal(err)
	}
	if w.writes != 1 || !bytes.Equal(w.Bytes(), whole) {
		t.Fatalf("%d writes of %q, want one of %q", w.writes, w.Bytes(), whole)
	}
}

// lastWithEOF returns its bytes with io.EOF, as crypto/tls returns a
// record's last bytes when a close_notify follows it.
type lastWithEOF struct{ data []byte }

func (l *lastWithEOF) Read(p []byte) (int, error) {
	n := copy(p, l.data)
	l.data = l.data[n:]
	if len(l.data) == 0 {
		return n, io.EOF
	}
	return n, nil
}

func TestAConnectionThatEndsWithAFramesLastBytesIsUnexpectedEOF(t *testing.T) {
	var r FrameReader
	src := &lastWithEOF{data: AppendData(nil, []byte("last"))}
	if _, _, err := r.Next(src); err != nil {
		t.Fatal(err)
	}
	n, err := r.Read(src, make([]byte, 8))
	if n != 4 || err != io.ErrUnexpectedEOF {
		t.Fatalf("read %d, %v; want the 4 bytes and io.ErrUnexpectedEOF: only an end ends a tunnel", n, err)
	}
}
