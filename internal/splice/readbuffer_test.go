package splice

import (
	"bytes"
	"io"
	"strings"
	"testing"

	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// chunks hands out its chunks one per Read.
type chunks [][]byte

func (c *chunks) Read(p []byte) (int, error) {
	n := copy(p, (*c)[0])
	if n == len((*c)[0]) {
		*c = (*c)[1:]
	} else {
		(*c)[0] = (*c)[0][n:]
	}
	return n, nil
}

func TestReadBufferHoldsAPooledBufferOnlyWhileReadsAreLarge(t *testing.T) {
	large := bytes.Repeat([]byte("b"), 3*wire.MaxFrame)
	src := chunks{[]byte("ping"), large, []byte("pong")}
	var b ReadBuffer
	var got []string
	var big []bool
	for len(src) > 0 {
		data, err := b.Read(&src)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, string(data))
		big = append(big, b.big != nil)
	}
	if strings.Join(got, "") != "ping"+string(large)+"pong" {
		t.Fatal("the bytes read are not the bytes sent")
	}
	// ping: small. Then 2 KiB fill the small buffer, and the rest comes
	// in wire.MaxFrame reads into the big one; pong goes back to small.
	if len(got[1]) != smallRead || len(got[2]) != wire.MaxFrame {
		t.Fatalf("reads of %d and %d bytes, want %d then %d", len(got[1]), len(got[2]), smallRead, wire.MaxFrame)
	}
	if big[0] || !big[1] || !big[len(big)-2] || big[len(big)-1] {
		t.Fatalf("holding a big buffer after each read: %v; want only after reads that filled theirs", big)
	}
	b.Release()
}

func TestReadFramesOwnTheirBytes(t *testing.T) {
	// Large reads, each a different byte: a frame that still shared the
	// buffer of a later read would show that read's byte.
	var src chunks
	var want []string
	for i := range 6 {
		chunk := bytes.Repeat([]byte{byte('a' + i)}, wire.MaxFrame)
		src = append(src, chunk)
		want = append(want, string(chunk))
	}
	src = append(src, []byte("pong"))
	want = append(want, "pong")
	var b ReadBuffer
	var frames []wire.Frame
	var got strings.Builder
	for len(src) > 0 {
		f, err := b.ReadFrame(&src)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.DataLen(); err != nil {
			t.Fatalf("ReadFrame's frame: %v", err)
		}
		frames = append(frames, f)
	}
	// Read only once every read is done, as gRPC sends a frame after the
	// splice has read the next.
	for i := range frames {
		payload, err := io.ReadAll(&frames[i])
		if err != nil {
			t.Fatal(err)
		}
		got.Write(payload)
		frames[i].Free()
	}
	if got.String() != strings.Join(want, "") {
		t.Fatal("the frames' bytes are not the bytes read, in order")
	}
	b.Release()
}

func TestAnEmptyReadIsAnEmptyFrame(t *testing.T) {
	var b ReadBuffer
	f, err := b.ReadFrame(strings.NewReader(""))
	if !f.Empty() || err != io.EOF {
		t.Fatalf("ReadFrame at EOF = a frame (empty %v), %v; want an empty one and io.EOF", f.Empty(), err)
	}
}

func TestSmallReadFramesOwnTheirBytes(t *testing.T) {
	// A small read's frame owns its bytes: a frame freed, and the read
	// buffer read into again, must not show in a frame still held, and a
	// frame partly read writes out the rest.
	var b ReadBuffer
	var frames []wire.Frame
	for i := range 4 {
		src := chunks{bytes.Repeat([]byte{byte('a' + i)}, 100+i)}
		f, err := b.ReadFrame(&src)
		if err != nil {
			t.Fatal(err)
		}
		if n, err := f.DataLen(); err != nil || n != 100+i {
			t.Fatalf("ReadFrame's frame: %d bytes, %v; want %d", n, err, 100+i)
		}
		frames = append(frames, f)
	}
	frames[0].Free()
	src := chunks{[]byte("xyz")}
	reused, err := b.ReadFrame(&src)
	if err != nil {
		t.Fatal(err)
	}
	for i := 1; i < len(frames); i++ {
		var first [1]byte
		if _, err := frames[i].Read(first[:]); err != nil {
			t.Fatal(err)
		}
		var rest bytes.Buffer
		if _, err := frames[i].WriteTo(&rest); err != nil {
			t.Fatal(err)
		}
		want := bytes.Repeat([]byte{byte('a' + i)}, 100+i)
		if got := append(first[:], rest.Bytes()...); !bytes.Equal(got, want) {
			t.Fatalf("frame %d holds %q, want %q", i, got, want)
		}
		frames[i].Free()
	}
	if _, err := reused.DataLen(); err != nil {
		t.Fatal(err)
	}
	if got, _ := io.ReadAll(&reused); string(got) != "xyz" {
		t.Fatalf("the last frame holds %q, want %q", got, "xyz")
	}
	reused.Free()
}
