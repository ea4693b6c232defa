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

// listenLoopback listens on a loopback port until the test ends; serve
// starts handing it connections.
func listenLoopback(t T) *loopbackProxy {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &loopbackProxy{Addr: lis.Addr().String(), lis: lis, closed: make(chan struct{})}
	t.Cleanup(p.close)
	return p
}

// start hands every connection to handle, which owns it, until the test
// ends. Call it once the value that embeds p is complete: handle reads it.
func (p *loopbackProxy) start(handle func(net.Conn)) {
	p.wg.Add(1)
	go p.serve(handle)
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
