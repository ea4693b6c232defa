package harness

import (
	"io"
	"net"
	"sync"
)

// Partition is a TCP path to one address that a test can cut, as a network
// partition does: while it is cut, every byte sent on it is lost, either
// way, on the connections open and on the new ones, which it accepts and
// never connects onward. A connection that lost bytes stays broken after
// the path heals: its peers see it hang (until a keepalive or a handshake
// timeout gives up on it) or fail; new connections work at once. This is
// the worst case of a real partition, where TCP may yet deliver what it
// retransmits after the path is back.
type Partition struct {
	*loopbackProxy // Addr is the path's

	to     string
	mu     sync.Mutex
	healed chan struct{} // closed while the path is whole
}

// StartPartition serves a path to the address to on a loopback port until
// the test ends; it starts whole.
func StartPartition(t T, to string) *Partition {
	t.Helper()
	p := &Partition{loopbackProxy: listenLoopback(t), to: to, healed: make(chan struct{})}
	close(p.healed)
	p.start(p.forward)
	return p
}

// Cut stops every byte on the path.
func (p *Partition) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.healed:
		p.healed = make(chan struct{})
	default:
	}
}

// Heal lets bytes through again, on new connections.
func (p *Partition) Heal() {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.healed:
	default:
		close(p.healed)
	}
}

// isCut reports whether the path is cut now.
func (p *Partition) isCut() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.healed:
		return false
	default:
		return true
	}
}

func (p *Partition) forward(c net.Conn) {
	defer c.Close()
	stop := make(chan struct{})
	defer close(stop)
	var up net.Conn
	var mu sync.Mutex
	go func() {
		select {
		case <-p.closed:
			c.Close()
			mu.Lock()
			if up != nil {
				up.Close()
			}
			mu.Unlock()
		case <-stop:
		}
	}()
	if p.isCut() {
		// Accepted, as a SYN that got through would be, and then nothing.
		_, _ = io.Copy(io.Discard, c)
		return
	}
	conn, err := net.Dial("tcp", p.to)
	if err != nil {
		return
	}
	mu.Lock()
	up = conn
	mu.Unlock()
	defer conn.Close()
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); p.copyLossy(conn, c) }()
	go func() { defer wg.Done(); p.copyLossy(c, conn) }()
	wg.Wait()
}

// copyLossy copies src to dst, losing what it reads while the path is cut,
// and passes src's end on to dst. Once it has lost a byte, the connection
// is broken for good: it loses everything after, as a TCP stream with a
// hole in it delivers nothing past the hole.
func (p *Partition) copyLossy(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	broken := false
	for {
		n, err := src.Read(buf)
		if n > 0 && !broken && p.isCut() {
			broken = true
		}
		if n > 0 && !broken {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				src.Close()
				return
			}
		}
		if err != nil {
			if broken {
				// Not even the end gets through a broken stream.
				return
			}
			if cw, ok := dst.(interface{ CloseWrite() error }); ok {
				_ = cw.CloseWrite()
			} else {
				dst.Close()
			}
			return
		}
	}
}
