package kcpplugin

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"testing"

	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// stream is a reproducible pseudo-random byte stream of a given length.
func stream(seed uint64, size int64) io.Reader {
	var s [32]byte
	s[0] = byte(seed)
	s[1] = byte(seed >> 8)
	return io.LimitReader(rand.NewChaCha8(s), size)
}

// transferResult is what the broker side of a transfer saw.
type transferResult struct {
	received int64
	sum      [sha256.Size]byte
	err      error
}

// hashAll reads r to its end and returns how much it read and its sha256.
func hashAll(r io.Reader) (int64, [sha256.Size]byte, error) {
	h := sha256.New()
	n, err := io.Copy(h, r)
	var sum [sha256.Size]byte
	copy(sum[:], h.Sum(nil))
	return n, sum, err
}

// peerReader reads a peer's incoming data frames as a byte stream.
type peerReader struct {
	p    *peer
	rest []byte
}

func (r *peerReader) Read(b []byte) (int, error) {
	for len(r.rest) == 0 {
		data, err := r.p.recv()
		if err != nil {
			return 0, err
		}
		r.rest = data
	}
	n := copy(b, r.rest)
	r.rest = r.rest[n:]
	return n, nil
}

// peerWriter sends what is written to it as data frames of at most frame
// bytes.
type peerWriter struct {
	p     *peer
	frame int
}

func (w peerWriter) Write(b []byte) (int, error) {
	written := 0
	for len(b) > 0 {
		chunk := b[:min(len(b), w.frame)]
		if err := w.p.send(chunk); err != nil {
			return written, err
		}
		written += len(chunk)
		b = b[len(chunk):]
	}
	return written, nil
}

// varyingWriter writes to w in pseudo-random sizes from 1 byte to max, many
// of them larger than wire.MaxFrame.
type varyingWriter struct {
	w   io.Writer
	rng *rand.Rand
	max int
}

func (v varyingWriter) Write(b []byte) (int, error) {
	written := 0
	for len(b) > 0 {
		n := min(len(b), 1+v.rng.IntN(v.max))
		m, err := v.w.Write(b[:n])
		written += m
		if err != nil {
			return written, err
		}
		if m != n {
			return written, io.ErrShortWrite
		}
		b = b[n:]
	}
	return written, nil
}

// TestLargeTransferBothWays sends 64 MiB each way at the same time and
// checks every byte arrives in order.
func TestLargeTransferBothWays(t *testing.T) {
	const size = 64 << 20
	const up, down = 1, 2 // stream seeds

	brokerSaw := make(chan transferResult, 1)
	d := startTunnels(t, func(p *peer) error {
		received := make(chan transferResult, 1)
		go func() {
			n, sum, err := hashAll(&peerReader{p: p})
			if errors.Is(err, io.EOF) {
				err = nil
			}
			received <- transferResult{n, sum, err}
		}()
		// Frames of assorted sizes, up to 1 MiB.
		if _, err := io.CopyBuffer(peerWriter{p: p, frame: 1 << 20}, stream(down, size), make([]byte, 100_000)); err != nil {
			return err
		}
		if err := p.closeWrite(); err != nil {
			return err
		}
		r := <-received
		brokerSaw <- r
		return r.err
	})
	c := dial(t, d)

	sent := make(chan error, 1)
	go func() {
		w := varyingWriter{w: c, rng: rand.New(rand.NewPCG(1, 2)), max: 3 * wire.MaxFrame}
		if _, err := io.CopyBuffer(w, stream(up, size), make([]byte, 256<<10)); err != nil {
			sent <- err
			return
		}
		sent <- c.(closeWriter).CloseWrite()
	}()
	n, sum, err := hashAll(c)
	if err != nil {
		t.Fatalf("reading: %v after %d bytes", err, n)
	}
	if err := within(t, sent, "the writer to finish"); err != nil {
		t.Fatalf("writing: %v", err)
	}

	_, wantDown, _ := hashAll(stream(down, size))
	_, wantUp, _ := hashAll(stream(up, size))
	if n != size || sum != wantDown {
		t.Errorf("caller received %d bytes with sha256 %x; want %d bytes with %x", n, sum, size, wantDown)
	}
	r := within(t, brokerSaw, "the broker's result")
	if r.err != nil || r.received != size || r.sum != wantUp {
		t.Errorf("broker received %d bytes with sha256 %x, %v; want %d bytes with %x", r.received, r.sum, r.err, size, wantUp)
	}
	receiveDone(t, c)
}

func TestLargeWritesAreSplitIntoFrames(t *testing.T) {
	frames := make(chan []int, 1)
	d := startTunnels(t, func(p *peer) error {
		var sizes []int
		defer func() { frames <- sizes }()
		for {
			data, err := p.recv() // fails on an empty frame
			if errors.Is(err, io.EOF) {
				return p.closeWrite()
			}
			if err != nil {
				return err
			}
			sizes = append(sizes, len(data))
		}
	})
	c := dial(t, d)

	for _, size := range []int{0, 1, wire.MaxFrame - 1, wire.MaxFrame, wire.MaxFrame + 1, 1<<20 + 1} {
		if n, err := c.Write(make([]byte, size)); n != size || err != nil {
			t.Fatalf("Write(%d bytes) = %d, %v", size, n, err)
		}
	}
	closeWrite(t, c)
	if _, err := io.ReadAll(c); err != nil {
		t.Fatalf("reading to the end: %v", err)
	}
	got := within(t, frames, "the frame sizes")
	want := []int{1, wire.MaxFrame - 1, wire.MaxFrame, wire.MaxFrame, 1}
	for range (1<<20 + 1) / wire.MaxFrame {
		want = append(want, wire.MaxFrame)
	}
	want = append(want, (1<<20+1)%wire.MaxFrame)
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("frame sizes = %v\nwant %v", got, want)
	}
}

// Reads smaller than a frame return it piece by piece, in order.
func TestSmallReads(t *testing.T) {
	data := make([]byte, 3*wire.MaxFrame+7)
	for i := range data {
		data[i] = byte(i % 251)
	}
	d := startTunnels(t, func(p *peer) error {
		if err := p.send(data[:wire.MaxFrame+3]); err != nil {
			return err
		}
		if err := p.send(data[wire.MaxFrame+3:]); err != nil {
			return err
		}
		if err := p.closeWrite(); err != nil {
			return err
		}
		_, err := p.recvAll()
		return err
	})
	c := dial(t, d)
	var got bytes.Buffer
	buf := make([]byte, 1000)
	for {
		n, err := c.Read(buf)
		got.Write(buf[:n])
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("Read: %v", err)
		}
		if n == 0 {
			t.Fatal("Read returned 0 bytes and no error")
		}
	}
	if !bytes.Equal(got.Bytes(), data) {
		t.Errorf("read %d bytes that differ from the %d sent", got.Len(), len(data))
	}
}

// Data frames are never empty, but should one be, Read does not return
// (0, nil) for it.
func TestEmptyDataFrameIsNotAnEmptyRead(t *testing.T) {
	d := startTunnels(t, func(p *peer) error {
		for _, f := range []string{"", "x", ""} {
			if err := p.send([]byte(f)); err != nil {
				return err
			}
		}
		if err := p.closeWrite(); err != nil {
			return err
		}
		_, err := p.recvAll()
		return err
	})
	c := dial(t, d)
	buf := make([]byte, 8)
	if n, err := c.Read(buf); n != 1 || err != nil || buf[0] != 'x' {
		t.Errorf("first Read = %q, %v; want %q, nil", buf[:n], err, "x")
	}
	if n, err := c.Read(buf); n != 0 || !errors.Is(err, io.EOF) {
		t.Errorf("second Read = %q, %v; want io.EOF", buf[:n], err)
	}
}
