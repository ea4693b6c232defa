package kcpplugin

import (
	"errors"
	"io"
	"testing"
)

func TestConnImplementsCloseWrite(t *testing.T) {
	d := startTunnels(t, func(p *peer) error { return p.echo() })
	c := dial(t, d)
	if _, ok := c.(closeWriter); !ok {
		t.Fatalf("%T does not implement CloseWrite() error", c)
	}
}

// After CloseWrite the broker reads EOF, and the caller still reads what the
// broker sends afterwards.
func TestCloseWriteThenRead(t *testing.T) {
	got := make(chan result, 1)
	d := startTunnels(t, func(p *peer) error {
		data, err := p.recvAll()
		got <- result{data: data, err: err}
		if err != nil {
			return err
		}
		// Answer only after the caller's EOF.
		if err := p.send([]byte("you said: ")); err != nil {
			return err
		}
		if err := p.send(data); err != nil {
			return err
		}
		return p.closeWrite()
	})
	c := dial(t, d)

	write(t, c, []byte("hello, "))
	write(t, c, []byte("broker"))
	closeWrite(t, c)

	r := within(t, got, "the broker to read EOF")
	if r.err != nil || string(r.data) != "hello, broker" {
		t.Fatalf("broker read %q, %v; want %q, EOF", r.data, r.err, "hello, broker")
	}
	r = within(t, goReadAll(c), "reading the answer")
	if r.err != nil || string(r.data) != "you said: hello, broker" {
		t.Fatalf("read %q, %v after CloseWrite; want the answer and EOF", r.data, r.err)
	}
	// EOF is sticky.
	if n, err := c.Read(make([]byte, 8)); n != 0 || !errors.Is(err, io.EOF) {
		t.Errorf("second Read after EOF = %d, %v; want 0, io.EOF", n, err)
	}
	// Both directions are closed and the broker returned OK: the stream ends.
	receiveDone(t, c)
}

func TestWriteAfterCloseWriteFails(t *testing.T) {
	got := make(chan result, 1)
	d := startTunnels(t, func(p *peer) error {
		data, err := p.recvAll()
		got <- result{data: data, err: err}
		return p.closeWrite()
	})
	c := dial(t, d)
	write(t, c, []byte("before"))
	closeWrite(t, c)
	if n, err := c.Write([]byte("after")); n != 0 || err == nil {
		t.Errorf("Write after CloseWrite = %d, %v; want an error", n, err)
	}
	// A second CloseWrite is harmless.
	if err := c.(closeWriter).CloseWrite(); err != nil {
		t.Errorf("second CloseWrite: %v", err)
	}
	if r := within(t, got, "the broker to read EOF"); r.err != nil || string(r.data) != "before" {
		t.Errorf("broker read %q, %v; want %q", r.data, r.err, "before")
	}
}

// After the broker's close_write the caller reads EOF, and still writes.
func TestPeerCloseWriteThenWrite(t *testing.T) {
	got := make(chan result, 1)
	d := startTunnels(t, func(p *peer) error {
		if err := p.send([]byte("greetings")); err != nil {
			return err
		}
		if err := p.closeWrite(); err != nil {
			return err
		}
		data, err := p.recvAll()
		got <- result{data: data, err: err}
		return err
	})
	c := dial(t, d)

	r := within(t, goReadAll(c), "reading until the broker's close_write")
	if r.err != nil || string(r.data) != "greetings" {
		t.Fatalf("read %q, %v; want %q and EOF", r.data, r.err, "greetings")
	}
	if n, err := c.Read(make([]byte, 8)); n != 0 || !errors.Is(err, io.EOF) {
		t.Errorf("Read after close_write = %d, %v; want 0, io.EOF", n, err)
	}

	write(t, c, []byte("still "))
	write(t, c, []byte("writing"))
	closeWrite(t, c)
	if r := within(t, got, "the broker to read EOF"); r.err != nil || string(r.data) != "still writing" {
		t.Errorf("broker read %q, %v; want %q", r.data, r.err, "still writing")
	}
	receiveDone(t, c)
	if err := c.Close(); err != nil {
		t.Errorf("Close after a clean end: %v", err)
	}
}
