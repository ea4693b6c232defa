package kcpplugin

import (
	"bytes"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

func TestReadWriteAfterClose(t *testing.T) {
	c := dial(t, startTunnels(t, func(p *peer) error { return p.echo() }))
	write(t, c, []byte("abc"))
	readFull(t, c, 1) // "bc" stays buffered

	if err := c.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	for range 3 {
		if n, err := c.Read(make([]byte, 8)); n != 0 || !errors.Is(err, net.ErrClosed) {
			t.Errorf("Read after Close = %d, %v; want 0, net.ErrClosed", n, err)
		}
		if n, err := c.Write([]byte("x")); n != 0 || !errors.Is(err, net.ErrClosed) {
			t.Errorf("Write after Close = %d, %v; want 0, net.ErrClosed", n, err)
		}
	}
	if err := c.(closeWriter).CloseWrite(); !errors.Is(err, net.ErrClosed) {
		t.Errorf("CloseWrite after Close = %v, want net.ErrClosed", err)
	}
}

func TestCloseIsIdempotent(t *testing.T) {
	c := dial(t, startTunnels(t, func(p *peer) error { return p.echo() }))
	var wg sync.WaitGroup
	for range 5 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := c.Close(); err != nil {
				t.Errorf("Close: %v", err)
			}
		}()
	}
	wg.Wait()
	if err := c.Close(); err != nil {
		t.Errorf("Close again: %v", err)
	}
	receiveDone(t, c)
}

func TestCloseUnblocksRead(t *testing.T) {
	c := dial(t, startTunnels(t, sendOnCue(nil)))
	read := goRead(c, 8)
	stillBlocked(t, read, 50*time.Millisecond, "Read with nothing to read")
	c.Close()
	r := within(t, read, "Read to return after Close")
	if r.n != 0 || !errors.Is(r.err, net.ErrClosed) {
		t.Errorf("blocked Read after Close = %d, %v; want 0, net.ErrClosed", r.n, r.err)
	}
	receiveDone(t, c)
}

func TestCloseUnblocksWrite(t *testing.T) {
	got := make(chan result, 1)
	c := dial(t, startTunnels(t, stallingPeer(nil, got)))
	write := goWrite(c, make([]byte, bigWrite))
	stillBlocked(t, write, 100*time.Millisecond, "Write to a peer that does not read")
	c.Close()
	r := within(t, write, "Write to return after Close")
	if r.n >= bigWrite || !errors.Is(r.err, net.ErrClosed) {
		t.Errorf("blocked Write after Close = %d, %v; want a short count and net.ErrClosed", r.n, r.err)
	}
	// Bytes stuck behind a peer that does not read cannot be delivered, so
	// Close aborts the tunnel at once.
	if r := within(t, got, "the broker to see the tunnel aborted"); r.err == nil {
		t.Error("broker's handler was not cancelled")
	}
	receiveDone(t, c)
}

// Close, like closing a TCP socket, still delivers what was written, then
// EOF.
func TestCloseDeliversWrittenBytes(t *testing.T) {
	got := make(chan result, 1)
	d := startTunnels(t, func(p *peer) error {
		data, err := p.recvAll()
		got <- result{n: len(data), data: data, err: err}
		if err != nil {
			return err
		}
		return p.closeWrite()
	})
	c := dial(t, d)
	data := bytes.Repeat([]byte("last words "), 100_000)
	write(t, c, data)
	write(t, c, []byte("!"))
	c.Close()

	r := within(t, got, "the broker to read EOF")
	if r.err != nil {
		t.Fatalf("broker's read ended with %v after %d bytes, want EOF", r.err, r.n)
	}
	if want := append(data, '!'); !bytes.Equal(r.data, want) {
		t.Errorf("broker read %d bytes, want the %d bytes written before Close", r.n, len(want))
	}
	receiveDone(t, c)
}

// A closed conn whose peer never ends the stream cancels it after
// closeLinger, so neither side holds on to it for ever.
func TestCloseLingerEndsAbandonedStream(t *testing.T) {
	t.Parallel()
	type event struct {
		what string
		err  error
	}
	events := make(chan event, 2)
	d := startTunnels(t, func(p *peer) error {
		_, err := p.recvAll()
		events <- event{"read", err}
		<-p.ctx().Done() // never close_write, never return
		events <- event{"cancelled", p.ctx().Err()}
		return nil
	})
	c := dial(t, d)
	write(t, c, []byte("bye"))
	c.Close()
	if e := within(t, events, "the broker to read EOF"); e.what != "read" || e.err != nil {
		t.Fatalf("broker: %s %v, want a clean EOF first", e.what, e.err)
	}
	if e := within(t, events, "the stream to be cancelled"); e.what != "cancelled" {
		t.Fatalf("broker: %s %v", e.what, e.err)
	}
	receiveDone(t, c)
	if _, err := c.Read(make([]byte, 1)); !errors.Is(err, net.ErrClosed) {
		t.Errorf("Read after Close = %v, want net.ErrClosed", err)
	}
	if _, err := io.ReadAll(c); !errors.Is(err, net.ErrClosed) {
		t.Errorf("ReadAll after Close = %v, want net.ErrClosed", err)
	}
}
