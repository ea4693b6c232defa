package fragments

import (
	"bytes"
	"errors"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"golang.org/x/net/http2"
	"golang.org/x/time/rate"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// These tests drive a conn over a fake secured connection, which hands
// gRPC's side the bytes a client sent, in pieces of a chosen size, and
// keeps what gRPC's side writes.

type fakeConn struct {
	net.Conn // nil: only what conn uses is here
	in       *bytes.Reader
	piece    int
	out      bytes.Buffer
}

func (f *fakeConn) Read(p []byte) (int, error) {
	return f.in.Read(p[:min(len(p), f.piece)])
}

func (f *fakeConn) Write(p []byte) (int, error)      { return f.out.Write(p) }
func (f *fakeConn) SetWriteDeadline(time.Time) error { return nil }
func (f *fakeConn) RemoteAddr() net.Addr             { return &net.TCPAddr{IP: net.IPv4(192, 0, 2, 1), Port: 4242} }

// written is what gRPC's side wrote.
func (f *fakeConn) written() []byte { return f.out.Bytes() }

// newFakeConn hands over in, in pieces of at most piece bytes.
func newFakeConn(in []byte, piece int) *fakeConn {
	return &fakeConn{in: bytes.NewReader(in), piece: piece}
}

// watched is a conn over f, as Refuse makes, and what it reports.
type watched struct {
	*conn
	closed int
	log    bytes.Buffer
}

func watch(f *fakeConn) *watched {
	w := &watched{}
	g := &guard{
		report: Report{Log: slog.New(slog.NewTextHandler(&w.log, nil)), Count: func() { w.closed++ }},
		logs:   &rate.Sometimes{First: LogsPerSecond, Interval: time.Second / LogsPerSecond},
	}
	w.conn = g.watch(f, nil)
	return w
}

// readAll reads c as gRPC does, to its end or error, and returns what gRPC
// got.
func readAll(c *conn) ([]byte, error) {
	var got []byte
	buf := make([]byte, 32<<10)
	for {
		n, err := c.Read(buf)
		got = append(got, buf[:n]...)
		if err != nil {
			return got, err
		}
	}
}

// dataFrames counts the DATA frames in what a client sent, and those of
// fewer than MinData bytes.
func dataFrames(b []byte) (all, small int) {
	s := newServerScanner(func(_ http2.FrameHeader, data uint32) {
		all++
		if data > 0 && data < MinData {
			small++
		}
	})
	s.scan(b)
	return all, small
}

// headers opens stream id.
func headers(fr *http2.Framer, id uint32) error {
	return fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: []byte("h"), EndHeaders: true})
}

func TestAPeerThatSendsOneByteFramesIsCutOffWithAGoAway(t *testing.T) {
	in := clientBytes(t, func(fr *http2.Framer) error {
		err := errors.Join(fr.WriteSettings(), headers(fr, 1), headers(fr, 3))
		for range 5000 {
			err = errors.Join(err, fr.WriteData(3, false, []byte{0}))
		}
		return err
	})
	for _, piece := range []int{1, 7, 100, 32 << 10} {
		f := newFakeConn(in, piece)
		c := watch(f)
		got, err := readAll(c.conn)
		if err == nil || errors.Is(err, io.EOF) || !strings.Contains(err.Error(), "fragmented data") {
			t.Fatalf("in pieces of %d: reading ended with %v, want fragmented data", piece, err)
		}
		// About a thousand reached gRPC, and not one past the allowance.
		_, small := dataFrames(got)
		if max := Floor / (1 + PerFrame); small > max {
			t.Errorf("in pieces of %d: %d 1-byte frames reached gRPC, more than the %d the allowance takes", piece, small, max)
		}
		if small < Floor/(1+PerFrame)-piece {
			t.Errorf("in pieces of %d: only %d 1-byte frames reached gRPC", piece, small)
		}
		if _, again := c.Read(make([]byte, 10)); again == nil {
			t.Errorf("in pieces of %d: a read after the refusal succeeded", piece)
		}
		if c.closed != 1 || !strings.Contains(c.log.String(), "closing a connection whose peer sends its data in fragments") {
			t.Errorf("in pieces of %d: counted %d, logged %q; want one of each", piece, c.closed, c.log.String())
		}
		goAway := readGoAway(t, f.written())
		if goAway.ErrCode != http2.ErrCodeEnhanceYourCalm || goAway.LastStreamID != 3 || string(goAway.DebugData()) != err.Error() {
			t.Errorf("in pieces of %d: peer told %v, last stream %d, %q; want ENHANCE_YOUR_CALM, 3, %q",
				piece, goAway.ErrCode, goAway.LastStreamID, goAway.DebugData(), err)
		}
	}
}

// readGoAway reads the one frame a conn wrote, a GOAWAY.
func readGoAway(t *testing.T, written []byte) *http2.GoAwayFrame {
	t.Helper()
	fr := http2.NewFramer(nil, bytes.NewReader(written))
	f, err := fr.ReadFrame()
	if err != nil {
		t.Fatalf("reading what the conn wrote (%d bytes): %v", len(written), err)
	}
	goAway, ok := f.(*http2.GoAwayFrame)
	if !ok {
		t.Fatalf("the conn wrote %v, want a GOAWAY", f)
	}
	if _, err := fr.ReadFrame(); !errors.Is(err, io.EOF) {
		t.Fatalf("after the GOAWAY: %v, want nothing", err)
	}
	return goAway
}

func TestPaddedFramesCountTheirPadding(t *testing.T) {
	// Whole messages, but each padded with 255 bytes, which gRPC holds
	// and returns to the peer's window.
	in := clientBytes(t, func(fr *http2.Framer) error {
		err := headers(fr, 1)
		for range 1000 {
			err = errors.Join(err, fr.WriteDataPadded(1, false, make([]byte, 20), make([]byte, 255)))
		}
		return err
	})
	c := watch(newFakeConn(in, 32<<10))
	got, err := readAll(c.conn)
	if err == nil || !strings.Contains(err.Error(), "fragmented data") {
		t.Fatalf("reading ended with %v, want fragmented data", err)
	}
	if all, _ := dataFrames(got); all > Floor/(1+20+255+PerFrame) {
		t.Errorf("%d padded frames reached gRPC, more than the allowance takes", all)
	}
}

func TestOrdinaryTrafficIsNotRefused(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	in := clientBytes(t, func(fr *http2.Framer) error {
		err := fr.WriteSettings()
		// Streams carrying whole messages of every size, the smallest in
		// great numbers, and half-closing with an empty frame.
		for id := uint32(1); id < 2000; id += 2 {
			err = errors.Join(err, headers(fr, id))
			for range 20 {
				err = errors.Join(err, fr.WriteData(id, false, make([]byte, MinData+rng.IntN(100))))
			}
			err = errors.Join(err, fr.WriteData(id, false, make([]byte, MinData)))
			err = errors.Join(err, fr.WriteData(id, false, make([]byte, 16384)))
			err = errors.Join(err, fr.WriteData(id, true, nil))
		}
		// Unary calls with empty requests (health checks): 5 bytes each,
		// ending their stream.
		for id := uint32(2001); id < 20000; id += 2 {
			err = errors.Join(err, headers(fr, id), fr.WriteData(id, true, make([]byte, 5)))
		}
		// Padded frames without data are dropped at once, and one that ends
		// its stream is its stream's last.
		for range 2000 {
			err = errors.Join(err, fr.WriteDataPadded(1, false, nil, make([]byte, 255)))
		}
		for id := uint32(20001); id < 22000; id += 2 {
			err = errors.Join(err, headers(fr, id), fr.WriteDataPadded(id, true, []byte{1}, make([]byte, 255)))
		}
		return err
	})
	for _, piece := range []int{1, 1000, 32 << 10} {
		f := newFakeConn(in, piece)
		c := watch(f)
		got, err := readAll(c.conn)
		if !errors.Is(err, io.EOF) || !bytes.Equal(got, in) {
			t.Fatalf("in pieces of %d: gRPC read %d of %d bytes, then %v; want all, then EOF", piece, len(got), len(in), err)
		}
		if c.closed != 0 || len(f.written()) != 0 {
			t.Errorf("in pieces of %d: %d connections reported closed, %d bytes written; want none", piece, c.closed, len(f.written()))
		}
	}
}

func TestGRPCsCutsAtWindowUpdatesStayWithinTheAllowance(t *testing.T) {
	// A gRPC sender sends a frame of fewer than MinData bytes only where
	// the receiver's window stops it: at worst the piece before the stop
	// and the rest of the message after it, at every window update. The
	// broker sends an update per 256 KiB a handler reads, or per 16 KiB
	// with dynamic windows. 1 GiB at either pace stays within the
	// allowance.
	for _, update := range []uint32{16 << 10, 256 << 10} {
		var tl tally
		for sent := int64(0); sent < 1<<30; sent += int64(update) {
			fragment := http2.FrameHeader{Type: http2.FrameData, Length: MinData - 1, StreamID: 1}
			bulk := http2.FrameHeader{Type: http2.FrameData, Length: 16384, StreamID: 1}
			over := tl.add(fragment, fragment.Length)
			for left := update - 2*fragment.Length; left > 0; left -= min(left, bulk.Length) {
				bulk.Length = min(left, 16384)
				over = over || tl.add(bulk, bulk.Length)
			}
			over = over || tl.add(fragment, fragment.Length)
			if over {
				t.Fatalf("updates every %d bytes: refused after %d bytes (%d fragments costing %d)", update, tl.data, tl.fragments, tl.cost)
			}
		}
	}
}

func TestAGoAwayNeverCutsAFrameOfGRPCs(t *testing.T) {
	oneByteFrames := clientBytes(t, func(fr *http2.Framer) error {
		err := headers(fr, 1)
		for range 2000 {
			err = errors.Join(err, fr.WriteData(1, false, []byte{0}))
		}
		return err
	})
	var b bytes.Buffer
	if err := http2.NewFramer(&b, nil).WriteData(1, false, make([]byte, 100)); err != nil {
		t.Fatal(err)
	}
	serverFrame := b.Bytes()

	// gRPC wrote half a frame: nothing may follow it but the rest.
	f := newFakeConn(oneByteFrames, 32<<10)
	c := watch(f)
	if _, err := c.Write(serverFrame[:50]); err != nil {
		t.Fatal(err)
	}
	if _, err := readAll(c.conn); err == nil || !strings.Contains(err.Error(), "fragmented data") {
		t.Fatalf("reading ended with %v, want fragmented data", err)
	}
	if !bytes.Equal(f.written(), serverFrame[:50]) {
		t.Errorf("after half a frame of gRPC's, the conn wrote %d bytes more", len(f.written())-50)
	}

	// gRPC is writing (perhaps waiting for a peer that does not read).
	f = newFakeConn(oneByteFrames, 32<<10)
	c = watch(f)
	c.wmu.Lock()
	_, err := readAll(c.conn)
	c.wmu.Unlock()
	if err == nil || len(f.written()) != 0 {
		t.Errorf("during a write of gRPC's: reading ended with %v, and the conn wrote %d bytes; want an error and nothing", err, len(f.written()))
	}

	// Whole frames: the GOAWAY follows them.
	f = newFakeConn(oneByteFrames, 32<<10)
	c = watch(f)
	if _, err := c.Write(serverFrame); err != nil {
		t.Fatal(err)
	}
	if _, err := readAll(c.conn); err == nil {
		t.Fatal("the peer was not refused")
	}
	readGoAway(t, f.written()[len(serverFrame):])
}

// BenchmarkReadingBulkData is what the guard adds to gRPC's reads of bulk
// data: 16 KiB frames, read 32 KiB at a time, as gRPC reads, through the
// guard and without it.
func BenchmarkReadingBulkData(b *testing.B) {
	var frames bytes.Buffer
	fr := http2.NewFramer(&frames, nil)
	for range 64 {
		if err := fr.WriteData(1, false, make([]byte, 16384)); err != nil {
			b.Fatal(err)
		}
	}
	in := frames.Bytes()
	for _, guarded := range []bool{false, true} {
		b.Run(map[bool]string{false: "unguarded", true: "guarded"}[guarded], func(b *testing.B) {
			f := newFakeConn(nil, 32<<10)
			var r io.Reader = f
			if guarded {
				c := watch(f)
				c.in.skip = 0 // no preface: frames only
				r = c
			}
			buf := make([]byte, 32<<10)
			b.SetBytes(int64(len(in)))
			for b.Loop() {
				f.in.Reset(in)
				for {
					if _, err := r.Read(buf); err != nil {
						break
					}
				}
			}
		})
	}
}
