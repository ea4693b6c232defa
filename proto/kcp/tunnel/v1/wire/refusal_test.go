package wire

import (
	"errors"
	"io"
	"net"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// tcpPair is a loopback TCP connection: the broker's end and the peer's.
func tcpPair(t *testing.T) (broker, peer *net.TCPConn) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := l.Accept()
		accepted <- c
	}()
	p, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	b := <-accepted
	if b == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { b.Close(); p.Close() })
	return b.(*net.TCPConn), p.(*net.TCPConn)
}

// readCounter counts the bytes read through it.
type readCounter struct {
	*net.TCPConn
	read atomic.Int64
}

func (c *readCounter) Read(p []byte) (int, error) {
	n, err := c.TCPConn.Read(p)
	c.read.Add(int64(n))
	return n, err
}

// closeRefused runs CloseRefused on conn and returns when it has.
func closeRefused(t *testing.T, conn net.Conn) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		CloseRefused(conn)
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("CloseRefused did not return")
	}
}

func TestARefusedPeersBytesAreReadUntilItCloses(t *testing.T) {
	broker, peer := tcpPair(t)
	request := make([]byte, 4096)
	if _, err := peer.Write(request); err != nil {
		t.Fatal(err)
	}
	peerDone := make(chan error, 1)
	go func() {
		// The peer reads the refusal's end, writes once more and closes.
		if _, err := peer.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
			peerDone <- err
			return
		}
		_, err := peer.Write(request)
		peer.Close()
		peerDone <- err
	}()
	closeRefused(t, broker)
	if err := <-peerDone; err != nil {
		t.Fatalf("the refused peer: %v; want its half-close read and its write taken", err)
	}
}

func TestAPeerThatGoesOnSendingIsReadNoFurtherThanRefusalDrain(t *testing.T) {
	broker, peer := tcpPair(t)
	go func() {
		chunk := make([]byte, 16<<10)
		for {
			if _, err := peer.Write(chunk); err != nil {
				return
			}
		}
	}()
	counted := &readCounter{TCPConn: broker}
	closeRefused(t, counted)
	if n := counted.read.Load(); n != RefusalDrain {
		t.Fatalf("read %d bytes of a peer that never stops; want RefusalDrain, %d", n, RefusalDrain)
	}
}

func TestAPeerThatNeitherSendsNorClosesIsClosedAfterRefusalLinger(t *testing.T) {
	broker, peer := tcpPair(t)
	closeRefused(t, broker)
	if _, err := peer.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Fatalf("the silent peer read %v; want the close", err)
	}
}

func TestRefusalsPastMaxLingeringAreClosedAtOnce(t *testing.T) {
	for range MaxLingering {
		lingering <- struct{}{}
	}
	defer func() {
		for range MaxLingering {
			<-lingering
		}
	}()
	broker, peer := tcpPair(t)
	if _, err := peer.Write(make([]byte, 4096)); err != nil {
		t.Fatal(err)
	}
	// Let the bytes reach the broker's socket, unread: closing it then
	// resets the connection rather than reading them.
	time.Sleep(50 * time.Millisecond)
	closeRefused(t, broker)
	if _, err := peer.Read(make([]byte, 1)); !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("with MaxLingering connections lingering, the peer read %v; want a reset, the close at once", err)
	}
}
