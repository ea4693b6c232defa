package kcpplugin

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// Many tunnels over one client connection at once, each echoing its own data.
func TestConcurrentConns(t *testing.T) {
	const conns = 50
	d := startTunnels(t, func(p *peer) error { return p.echo() })

	var wg sync.WaitGroup
	errs := make(chan error, conns)
	for i := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- echoOnce(d, i, 2000+i*37)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
}

// echoOnce dials, writes repeat times a line unique to i, half-closes and
// checks the echo.
func echoOnce(d *Dialer, i, repeat int) error {
	c, err := d.DialService(context.Background(), testCluster, testNamespace, testService, testPort)
	if err != nil {
		return fmt.Errorf("conn %d: DialService: %w", i, err)
	}
	defer c.Close()
	data := bytes.Repeat(fmt.Appendf(nil, "conn %d says hi; ", i), repeat)

	written := make(chan error, 1)
	go func() {
		if _, err := c.Write(data); err != nil {
			written <- err
			return
		}
		written <- c.(closeWriter).CloseWrite()
	}()
	got, err := io.ReadAll(c)
	if werr := <-written; werr != nil {
		return fmt.Errorf("conn %d: writing: %w", i, werr)
	}
	if err != nil {
		return fmt.Errorf("conn %d: reading: %w", i, err)
	}
	if !bytes.Equal(got, data) {
		return fmt.Errorf("conn %d: echo of %d bytes differs from the %d bytes sent", i, len(got), len(data))
	}
	return nil
}

// A caller that does not read one tunnel must not stall the others on the
// same client connection: gRPC's per-stream flow control holds back only the
// unread tunnel.
func TestSlowReaderDoesNotStallOtherConns(t *testing.T) {
	const flood = 1 << 30 // more than any flow-control window
	var floodSent atomic.Int64
	floodDone := make(chan error, 1)
	d := startTunnels(t, func(p *peer) error {
		if p.target.GetService() != "flood" {
			return p.echo()
		}
		return floodUntilHalfClosed(p, flood, &floodSent, floodDone)
	})

	slow, err := d.DialService(context.Background(), testCluster, testNamespace, "flood", testPort)
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Close()
	// Read a little, so the flood has surely started, then stop reading.
	readFull(t, slow, 1)

	// Several MiB each, far more than the unread tunnel's window.
	for i := range 3 {
		if err := echoOnce(d, i, 300_000); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case err := <-floodDone:
		t.Fatalf("the flood ended (%v) after %d bytes although nobody read it", err, floodSent.Load())
	default:
	}
	t.Logf("flood held back after %d bytes", floodSent.Load())

	// Closing the unread tunnel releases the flood: its sender stops.
	slow.Close()
	if err := within(t, floodDone, "the flood to stop"); err != nil {
		t.Logf("flood ended with %v", err)
	}
	receiveDone(t, slow)
}

// floodUntilHalfClosed sends frames of wire.MaxFrame bytes to the caller
// until the caller half-closes, or until it has sent flood bytes in all,
// counting them in sent. It reports on done how the sending ended (nil,
// or the send's error); after a clean end it waits for the caller's
// half-close and half-closes in turn.
func floodUntilHalfClosed(p *peer, flood int64, sent *atomic.Int64, done chan<- error) error {
	eof := make(chan struct{})
	go func() {
		_, _ = p.recvAll()
		close(eof)
	}()
	chunk := make([]byte, wire.MaxFrame)
	var err error
	for sent.Load() < flood {
		select {
		case <-eof:
		default:
			if err = p.send(chunk); err == nil {
				sent.Add(int64(len(chunk)))
				continue
			}
		}
		break
	}
	done <- err
	if err != nil {
		return err
	}
	<-eof
	return p.closeWrite()
}

// Concurrent Writes on one conn do not interleave: each Write's bytes arrive
// together, also when a Write is split into several frames.
func TestConcurrentWritesDoNotInterleave(t *testing.T) {
	const writers, writes = 8, 20
	const size = 2*wire.MaxFrame + 100
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

	var wg sync.WaitGroup
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range writes {
				record := bytes.Repeat([]byte{byte('a' + w)}, size)
				record[0] = byte(i) // order within one writer
				if _, err := c.Write(record); err != nil {
					t.Errorf("writer %d: %v", w, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	closeWrite(t, c)

	r := within(t, got, "the broker to read everything")
	if r.err != nil || r.n != writers*writes*size {
		t.Fatalf("broker read %d bytes, %v; want %d", r.n, r.err, writers*writes*size)
	}
	next := make(map[byte]int)
	for off := 0; off < r.n; off += size {
		record := r.data[off : off+size]
		w := record[1]
		if !bytes.Equal(record[1:], bytes.Repeat([]byte{w}, size-1)) {
			t.Fatalf("record at %d mixes writers", off)
		}
		if int(record[0]) != next[w] {
			t.Fatalf("writer %c: record %d arrived when %d was due", w, record[0], next[w])
		}
		next[w]++
	}
}
