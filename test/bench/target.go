// Package bench holds what the tunnel's benchmarks share: loopback target
// servers (echo, bulk source and sink, flood), the client side of their small
// protocol, latency samples and readings of a process's memory, threads and
// goroutines. The load tool is cmd/tunnelbench; the Go benchmarks of the hot
// paths are this package's tests.
package bench

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
)

// Target is a TCP server on a loopback port that the benchmarks reach either
// directly or through the tunnel. Close ends it and every connection it
// accepted, so no handler outlives a measurement.
type Target struct {
	Addr string

	l      net.Listener
	handle func(*Target, net.Conn)

	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup

	// Flooded counts the bytes flood requests managed to write: what a
	// stalled reader has pending in the path's buffers.
	Flooded atomic.Int64
	// Accepted counts connections.
	Accepted atomic.Int64
}

// StartEcho serves echo: every byte read is written back.
func StartEcho() (*Target, error) { return start(echo) }

// StartBulk serves the bulk protocol: each connection sends one request (see
// Download, Upload and Flood).
func StartBulk() (*Target, error) { return start(bulk) }

func start(handle func(*Target, net.Conn)) (*Target, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	t := &Target{Addr: l.Addr().String(), l: l, handle: handle, conns: map[net.Conn]struct{}{}}
	t.wg.Add(1)
	go t.accept()
	return t, nil
}

func (t *Target) accept() {
	defer t.wg.Done()
	for {
		c, err := t.l.Accept()
		if err != nil {
			return
		}
		t.Accepted.Add(1)
		t.mu.Lock()
		if t.closed {
			t.mu.Unlock()
			c.Close()
			return
		}
		t.conns[c] = struct{}{}
		t.wg.Add(1)
		t.mu.Unlock()
		go func() {
			defer t.wg.Done()
			defer t.forget(c)
			t.handle(t, c)
		}()
	}
}

func (t *Target) forget(c net.Conn) {
	c.Close()
	t.mu.Lock()
	delete(t.conns, c)
	t.mu.Unlock()
}

// Open is the number of connections the target holds now.
func (t *Target) Open() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.conns)
}

// CloseConns closes every connection the target holds, keeping it listening.
func (t *Target) CloseConns() {
	t.mu.Lock()
	defer t.mu.Unlock()
	for c := range t.conns {
		c.Close()
	}
}

// Close stops listening, closes every connection and waits for the handlers.
func (t *Target) Close() {
	t.l.Close()
	t.mu.Lock()
	t.closed = true
	for c := range t.conns {
		c.Close()
	}
	t.mu.Unlock()
	t.wg.Wait()
}

// echoBuffer is the echo server's read size. A 64-byte round trip needs one
// read; bulk echo is not measured.
const echoBuffer = 32 << 10

func echo(_ *Target, c net.Conn) {
	buf := make([]byte, echoBuffer)
	for {
		n, err := c.Read(buf)
		if n > 0 {
			if _, werr := c.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			if tc, ok := c.(*net.TCPConn); ok && errors.Is(err, io.EOF) {
				_ = tc.CloseWrite()
			}
			return
		}
	}
}

// Requests of the bulk protocol: one byte, then the size as a big-endian
// uint64.
const (
	opDownload = 'D' // the target writes size bytes, then half-closes
	opUpload   = 'U' // the target reads size bytes, then writes size back as its acknowledgement
	opFlood    = 'F' // the target writes up to size bytes, counting them in Flooded, until the connection ends
)

// BulkBuffer is the size of the bulk target's writes and reads, and of the
// clients' below: large enough that the direct path is not syscall-bound.
const BulkBuffer = 256 << 10

var pattern = func() []byte {
	b := make([]byte, BulkBuffer)
	for i := range b {
		b[i] = byte(i * 7)
	}
	return b
}()

func bulk(t *Target, c net.Conn) {
	var req [9]byte
	if _, err := io.ReadFull(c, req[:]); err != nil {
		return
	}
	size := int64(binary.BigEndian.Uint64(req[1:]))
	switch req[0] {
	case opDownload, opFlood:
		for left := size; left > 0; {
			n, err := c.Write(pattern[:min(left, int64(len(pattern)))])
			left -= int64(n)
			if req[0] == opFlood {
				t.Flooded.Add(int64(n))
			}
			if err != nil {
				return
			}
		}
		if tc, ok := c.(*net.TCPConn); ok {
			_ = tc.CloseWrite()
		}
		// Wait for the client to finish reading and close.
		_, _ = io.Copy(io.Discard, c)
	case opUpload:
		got, err := drain(c, size, make([]byte, BulkBuffer))
		if err != nil {
			return
		}
		var ack [8]byte
		binary.BigEndian.PutUint64(ack[:], uint64(got))
		if _, err := c.Write(ack[:]); err != nil {
			return
		}
		_, _ = io.Copy(io.Discard, c)
	}
}

func request(c net.Conn, op byte, size int64) error {
	var req [9]byte
	req[0] = op
	binary.BigEndian.PutUint64(req[1:], uint64(size))
	_, err := c.Write(req[:])
	return err
}

// Download asks a bulk target for size bytes and reads them with buf.
func Download(c net.Conn, size int64, buf []byte) error {
	if err := request(c, opDownload, size); err != nil {
		return err
	}
	got, err := drain(c, size, buf)
	if err != nil {
		return fmt.Errorf("download: got %d of %d bytes: %w", got, size, err)
	}
	return nil
}

// drain reads and drops exactly size bytes with reads of len(buf). (Not
// io.Copy to io.Discard: that reads 8 KiB at a time.)
func drain(c net.Conn, size int64, buf []byte) (int64, error) {
	var got int64
	for got < size {
		n, err := c.Read(buf[:min(size-got, int64(len(buf)))])
		got += int64(n)
		if err != nil {
			if errors.Is(err, io.EOF) && got < size {
				err = io.ErrUnexpectedEOF
			}
			if got == size {
				return got, nil
			}
			return got, err
		}
	}
	return got, nil
}

// Upload sends size bytes to a bulk target in writes of len(buf) and waits
// for its acknowledgement that all of them arrived.
func Upload(c net.Conn, size int64, buf []byte) error {
	if err := request(c, opUpload, size); err != nil {
		return err
	}
	for left := size; left > 0; {
		n, err := c.Write(buf[:min(left, int64(len(buf)))])
		left -= int64(n)
		if err != nil {
			return err
		}
	}
	var ack [8]byte
	if _, err := io.ReadFull(c, ack[:]); err != nil {
		return fmt.Errorf("upload: reading the acknowledgement: %w", err)
	}
	if got := int64(binary.BigEndian.Uint64(ack[:])); got != size {
		return fmt.Errorf("upload: target got %d of %d bytes", got, size)
	}
	return nil
}

// Flood asks a bulk target to write size bytes, and reads none of them.
func Flood(c net.Conn, size int64) error { return request(c, opFlood, size) }

// RoundTrip writes msg to an echo target and reads it back into buf.
func RoundTrip(c net.Conn, msg, buf []byte) error {
	if _, err := c.Write(msg); err != nil {
		return err
	}
	if _, err := io.ReadFull(c, buf[:len(msg)]); err != nil {
		return err
	}
	return nil
}
