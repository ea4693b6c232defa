package kcpplugin

import (
	"bytes"
	"errors"
	"io"
	"net"
	"testing"
	"time"
)

// sendOnCue is a broker that sends each value of cue as a data frame, and
// ends cleanly once the caller half-closed.
func sendOnCue(cue <-chan string) func(p *peer) error {
	return func(p *peer) error {
		eof := make(chan error, 1)
		go func() {
			_, err := p.recvAll()
			eof <- err
		}()
		for {
			select {
			case s := <-cue:
				if err := p.send([]byte(s)); err != nil {
					return err
				}
			case err := <-eof:
				if err != nil {
					return err
				}
				return p.closeWrite()
			}
		}
	}
}

func wantTimeout(t *testing.T, what string, n int, err error) {
	t.Helper()
	if n != 0 || !isTimeout(err) {
		t.Fatalf("%s = %d, %v; want 0 and a timeout wrapping os.ErrDeadlineExceeded", what, n, err)
	}
}

func TestReadDeadlineInThePast(t *testing.T) {
	cue := make(chan string, 1)
	c := dial(t, startTunnels(t, sendOnCue(cue)))
	cue <- "hello world"
	if got := readFull(t, c, 5); string(got) != "hello" {
		t.Fatalf("read %q", got)
	}

	// " world" is buffered, yet a passed deadline fails the Read, as it
	// does on a TCP conn.
	if err := c.SetReadDeadline(time.Now().Add(-time.Second)); err != nil {
		t.Fatal(err)
	}
	for range 20 {
		n, err := c.Read(make([]byte, 64))
		wantTimeout(t, "Read with a passed deadline", n, err)
	}

	if err := c.SetReadDeadline(time.Time{}); err != nil {
		t.Fatal(err)
	}
	if got := readFull(t, c, 6); string(got) != " world" {
		t.Errorf("read %q after clearing the deadline, want %q", got, " world")
	}
}

func TestReadDeadlineUnblocksRead(t *testing.T) {
	c := dial(t, startTunnels(t, sendOnCue(nil)))
	if err := c.SetReadDeadline(time.Now().Add(100 * time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	r := within(t, goRead(c, 64), "Read to time out")
	wantTimeout(t, "Read past its deadline", r.n, r.err)
}

func TestReadDeadlineMovedWhileBlocked(t *testing.T) {
	t.Run("earlier", func(t *testing.T) {
		t.Parallel()
		c := dial(t, startTunnels(t, sendOnCue(nil)))
		if err := c.SetReadDeadline(time.Now().Add(time.Hour)); err != nil {
			t.Fatal(err)
		}
		read := goRead(c, 64)
		stillBlocked(t, read, 50*time.Millisecond, "Read with a far deadline")
		if err := c.SetReadDeadline(time.Now()); err != nil {
			t.Fatal(err)
		}
		r := within(t, read, "Read to time out")
		wantTimeout(t, "Read after the deadline was moved to now", r.n, r.err)
	})

	t.Run("set while blocked", func(t *testing.T) {
		t.Parallel()
		c := dial(t, startTunnels(t, sendOnCue(nil)))
		read := goRead(c, 64)
		stillBlocked(t, read, 50*time.Millisecond, "Read without a deadline")
		if err := c.SetReadDeadline(time.Now().Add(50 * time.Millisecond)); err != nil {
			t.Fatal(err)
		}
		r := within(t, read, "Read to time out")
		wantTimeout(t, "Read after a deadline was set", r.n, r.err)
	})

	// The deadline is moved away right after the Read starts; the Read must
	// outlive the old deadline and then get data.
	for _, tt := range []struct {
		name string
		to   time.Time
	}{
		{"later", time.Now().Add(time.Hour)},
		{"cleared", time.Time{}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cue := make(chan string, 1)
			c := dial(t, startTunnels(t, sendOnCue(cue)))
			const old = 500 * time.Millisecond
			if err := c.SetReadDeadline(time.Now().Add(old)); err != nil {
				t.Fatal(err)
			}
			read := goRead(c, 64)
			if err := c.SetReadDeadline(tt.to); err != nil {
				t.Fatal(err)
			}
			stillBlocked(t, read, 2*old, "Read after its deadline was moved away")
			cue <- "late"
			if r := within(t, read, "Read to get data"); r.err != nil || string(r.data) != "late" {
				t.Errorf("Read = %q, %v; want %q", r.data, r.err, "late")
			}
		})
	}
}

func TestReadAfterTimeout(t *testing.T) {
	cue := make(chan string, 1)
	c := dial(t, startTunnels(t, sendOnCue(cue)))
	if err := c.SetReadDeadline(time.Now().Add(50 * time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	r := within(t, goRead(c, 64), "Read to time out")
	wantTimeout(t, "Read", r.n, r.err)

	// Data that arrives after the timeout is kept for a later Read.
	cue <- "after the timeout"
	n, err := c.Read(make([]byte, 64))
	wantTimeout(t, "Read while the deadline is still passed", n, err)

	if err := c.SetReadDeadline(time.Time{}); err != nil {
		t.Fatal(err)
	}
	if got := readFull(t, c, len("after the timeout")); string(got) != "after the timeout" {
		t.Errorf("read %q after clearing the deadline", got)
	}

	// A new deadline in the future works like the first.
	if err := c.SetReadDeadline(time.Now().Add(50 * time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	r = within(t, goRead(c, 64), "Read to time out again")
	wantTimeout(t, "second timed-out Read", r.n, r.err)
}

func TestSetDeadlineSetsBoth(t *testing.T) {
	c := dial(t, startTunnels(t, func(p *peer) error { return p.echo() }))
	if err := c.SetDeadline(time.Now().Add(-time.Second)); err != nil {
		t.Fatal(err)
	}
	n, err := c.Read(make([]byte, 8))
	wantTimeout(t, "Read", n, err)
	n, err = c.Write([]byte("x"))
	wantTimeout(t, "Write", n, err)

	// A Write that failed before sending anything leaves the tunnel intact.
	if err := c.SetDeadline(time.Time{}); err != nil {
		t.Fatal(err)
	}
	write(t, c, []byte("ok"))
	if got := readFull(t, c, 2); string(got) != "ok" {
		t.Errorf("echo = %q", got)
	}
}

// stallingPeer is a broker that does not read until go_ is closed, so the
// caller's writes fill the flow-control windows and then block. Afterwards
// it reads until EOF and reports what it got.
func stallingPeer(goAhead <-chan struct{}, got chan<- result) func(p *peer) error {
	return func(p *peer) error {
		select {
		case <-goAhead:
		case <-p.ctx().Done():
			got <- result{err: p.ctx().Err()}
			return p.ctx().Err()
		}
		data, err := p.recvAll()
		got <- result{n: len(data), data: data, err: err}
		if err != nil {
			return err
		}
		return p.closeWrite()
	}
}

// bigWrite is larger than the flow-control windows can hold (gRPC grows a
// window to 16 MiB at most), so writing it to a peer that does not read
// blocks.
const bigWrite = 32 << 20

func goWrite(c net.Conn, b []byte) <-chan result {
	ch := make(chan result, 1)
	go func() {
		n, err := c.Write(b)
		ch <- result{n: n, err: err}
	}()
	return ch
}

// A write deadline that passes while Write waits for a peer that does not
// read fails that Write with a timeout and leaves the tunnel usable: the
// bytes Write counted arrive, in order, and so does what is written once
// the deadline is cleared.
func TestWriteDeadlineToStalledPeerKeepsTunnel(t *testing.T) {
	goAhead := make(chan struct{})
	got := make(chan result, 1)
	c := dial(t, startTunnels(t, stallingPeer(goAhead, got)))
	if err := c.SetWriteDeadline(time.Now().Add(300 * time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	var sent bytes.Buffer
	chunk := make([]byte, 1<<20)
	var err error
	for i := 0; sent.Len() < 4*bigWrite; i++ {
		for j := range chunk {
			chunk[j] = byte(i + j)
		}
		var n int
		n, err = c.Write(chunk)
		sent.Write(chunk[:n])
		if err != nil {
			break
		}
	}
	if err == nil {
		t.Fatalf("wrote %d bytes to a peer that does not read without blocking", sent.Len())
	}
	if !isTimeout(err) {
		t.Fatalf("Write = %v; want a timeout wrapping os.ErrDeadlineExceeded", err)
	}
	t.Logf("write timed out after %d bytes", sent.Len())
	n, err := c.Write([]byte("x"))
	wantTimeout(t, "Write while the deadline is still passed", n, err)

	if err := c.SetWriteDeadline(time.Time{}); err != nil {
		t.Fatal(err)
	}
	close(goAhead)
	write(t, c, []byte("after"))
	sent.WriteString("after")
	closeWrite(t, c)
	r := within(t, got, "the broker to read everything")
	if r.err != nil || !bytes.Equal(r.data, sent.Bytes()) {
		t.Errorf("broker read %d bytes, %v; want the %d bytes Write counted, in order", r.n, r.err, sent.Len())
	}
	if _, err := io.ReadAll(c); err != nil {
		t.Errorf("reading to the clean end: %v", err)
	}
}

func TestWriteDeadlineInThePastKeepsTunnel(t *testing.T) {
	c := dial(t, startTunnels(t, func(p *peer) error { return p.echo() }))
	if err := c.SetWriteDeadline(time.Now().Add(-time.Second)); err != nil {
		t.Fatal(err)
	}
	n, err := c.Write([]byte("x"))
	wantTimeout(t, "Write with a passed deadline", n, err)
	if err := c.SetWriteDeadline(time.Time{}); err != nil {
		t.Fatal(err)
	}
	write(t, c, []byte("fine"))
	if got := readFull(t, c, 4); string(got) != "fine" {
		t.Errorf("echo = %q", got)
	}
}

// A deadline that passes after a Write returned does not touch the tunnel.
func TestWriteDeadlinePassingAfterWriteKeepsTunnel(t *testing.T) {
	c := dial(t, startTunnels(t, func(p *peer) error { return p.echo() }))
	if err := c.SetWriteDeadline(time.Now().Add(300 * time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	write(t, c, []byte("before "))
	within(t, c.(*conn).writeDL.wait(), "the write deadline to pass")
	n, err := c.Write([]byte("x"))
	wantTimeout(t, "Write after the deadline passed", n, err)
	if err := c.SetWriteDeadline(time.Time{}); err != nil {
		t.Fatal(err)
	}
	write(t, c, []byte("after"))
	if got := readFull(t, c, len("before after")); string(got) != "before after" {
		t.Errorf("echo = %q", got)
	}
}

func TestWriteDeadlineMovedWhileBlocked(t *testing.T) {
	for _, tt := range []struct {
		name  string
		first time.Time
	}{
		{"from far away to now", time.Now().Add(time.Hour)},
		{"from none to now", time.Time{}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			goAhead := make(chan struct{})
			got := make(chan result, 1)
			c := dial(t, startTunnels(t, stallingPeer(goAhead, got)))
			if err := c.SetWriteDeadline(tt.first); err != nil {
				t.Fatal(err)
			}
			data := bytes.Repeat([]byte("0123456789abcdef"), bigWrite/16)
			write := goWrite(c, data)
			stillBlocked(t, write, 100*time.Millisecond, "Write to a peer that does not read")
			if err := c.SetWriteDeadline(time.Now()); err != nil {
				t.Fatal(err)
			}
			r := within(t, write, "Write to time out")
			if !isTimeout(r.err) || r.n >= bigWrite {
				t.Fatalf("Write = %d, %v; want a short count and a timeout", r.n, r.err)
			}
			// The tunnel goes on: the peer gets what Write counted.
			close(goAhead)
			closeWrite(t, c)
			read := within(t, got, "the broker to read everything")
			if read.err != nil || !bytes.Equal(read.data, data[:r.n]) {
				t.Errorf("broker read %d bytes, %v; want the %d bytes Write counted", read.n, read.err, r.n)
			}
		})
	}

	// The deadline is cleared right after the Write starts; the Write must
	// outlive the old deadline and complete once the peer reads.
	t.Run("cleared", func(t *testing.T) {
		t.Parallel()
		goAhead := make(chan struct{})
		got := make(chan result, 1)
		c := dial(t, startTunnels(t, stallingPeer(goAhead, got)))
		data := bytes.Repeat([]byte("0123456789abcdef"), bigWrite/16)
		const old = 500 * time.Millisecond
		if err := c.SetWriteDeadline(time.Now().Add(old)); err != nil {
			t.Fatal(err)
		}
		write := goWrite(c, data)
		if err := c.SetWriteDeadline(time.Time{}); err != nil {
			t.Fatal(err)
		}
		stillBlocked(t, write, 2*old, "Write to a peer that does not read")
		close(goAhead)
		if r := within(t, write, "Write to complete"); r.err != nil || r.n != len(data) {
			t.Fatalf("Write = %d, %v; want %d, nil", r.n, r.err, len(data))
		}
		closeWrite(t, c)
		r := within(t, got, "the broker to read everything")
		if r.err != nil || !bytes.Equal(r.data, data) {
			t.Errorf("broker read %d bytes, %v; want the %d bytes written", r.n, r.err, len(data))
		}
		if _, err := io.ReadAll(c); err != nil {
			t.Errorf("reading to the clean end: %v", err)
		}
	})
}

// The deadline errors are the standard ones callers test for.
func TestDeadlineErrorIsTimeout(t *testing.T) {
	c := dial(t, startTunnels(t, sendOnCue(nil)))
	_ = c.SetReadDeadline(time.Now().Add(-time.Second))
	_, err := c.Read(make([]byte, 1))
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Errorf("Read error %v (%T) is not a net.Error with Timeout() true", err, err)
	}
}
