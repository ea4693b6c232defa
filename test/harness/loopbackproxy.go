package harness

import (
	"net"
	"sync"
)

// loopbackProxy is what the test's stand-ins for the network (ServiceVIP,
// Partition) share: a loopback listener whose connections are each handled
// in a goroutine of their own until the test ends. Handlers let go of their
// connections once closed is closed; the test's end waits for them.
type loopbackProxy struct {
	Addr string

	lis    net.Listener
	wg     sync.WaitGroup
	closed chan struct{}
}

// startLoopbackProxy listens on a loopback port and hands every connection
// to handle, which owns it, until the test ends.
func startLoopbackProxy(t T, handle func(net.Conn)) *loopbackProxy {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &loopbackProxy{Addr: lis.Addr().String(), lis: lis, closed: make(chan struct{})}
	p.wg.Add(1)
	go p.serve(handle)
	t.Cleanup(p.close)
	return p
}

func (p *loopbackProxy) serve(handle func(net.Conn)) {
	defer p.wg.Done()
	for {
		c, err := p.lis.Accept()
		if err != nil {
			return
		}
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			handle(c)
		}()
	}
}

func (p *loopbackProxy) close() {
	select {
	case <-p.closed:
		return
	default:
	}
	close(p.closed)
	_ = p.lis.Close()
	p.wg.Wait()
}
