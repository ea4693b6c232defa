package harness

import (
	"io"
	"net"
	"slices"
	"sync"
	"time"
)

// ServiceVIP stands in for a ClusterIP Service and kube-proxy, which is how
// kcp reaches the broker replicas (deploy/README.md, "Services"): one
// address, behind which each new connection goes to one of the ready
// replicas, round robin, and is refused (closed at once) while none is. As
// kube-proxy does, it leaves open connections alone when their replica
// turns unready: only a GOAWAY or the replica's end moves them.
type ServiceVIP struct {
	*loopbackProxy // Addr is the VIP's

	mu        sync.Mutex
	endpoints []string
	next      int
	open      map[string]int // connections open, by endpoint
}

// StartServiceVIP serves a VIP on a loopback port until the test ends.
func StartServiceVIP(t T) *ServiceVIP {
	t.Helper()
	v := &ServiceVIP{loopbackProxy: listenLoopback(t), open: map[string]int{}}
	v.start(v.forward)
	return v
}

// SetEndpoints makes addrs the ready replicas, as the endpoints controller
// does from their readiness.
func (v *ServiceVIP) SetEndpoints(addrs ...string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.endpoints = slices.Clone(addrs)
}

// Endpoints are the ready replicas now.
func (v *ServiceVIP) Endpoints() []string {
	v.mu.Lock()
	defer v.mu.Unlock()
	return slices.Clone(v.endpoints)
}

// FollowReadiness keeps the endpoints to those replicas whose /readyz
// answers 200, polled every 100ms, until the test ends. replicas maps each
// replica's gRPC address to its process, and is read under its lock; a
// replica that has exited is dropped.
func (v *ServiceVIP) FollowReadiness(t T, mu *sync.Mutex, replicas map[string]*Process) {
	v.wg.Add(1)
	go func() {
		defer v.wg.Done()
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			mu.Lock()
			var ready []string
			for addr, p := range replicas {
				select {
				case <-p.Done():
					continue
				default:
				}
				if p.ReadyNow() {
					ready = append(ready, addr)
				}
			}
			mu.Unlock()
			slices.Sort(ready)
			v.SetEndpoints(ready...)
			select {
			case <-v.closed:
				return
			case <-tick.C:
			}
		}
	}()
}

// Open is the number of connections open through the VIP, by replica.
func (v *ServiceVIP) Open() map[string]int {
	v.mu.Lock()
	defer v.mu.Unlock()
	out := map[string]int{}
	for addr, n := range v.open {
		if n > 0 {
			out[addr] = n
		}
	}
	return out
}

func (v *ServiceVIP) pick() string {
	v.mu.Lock()
	defer v.mu.Unlock()
	if len(v.endpoints) == 0 {
		return ""
	}
	v.next++
	return v.endpoints[v.next%len(v.endpoints)]
}

// forward connects c to a ready replica and copies both ways until both
// directions are done, or the VIP closes.
func (v *ServiceVIP) forward(c net.Conn) {
	defer c.Close()
	endpoint := v.pick()
	if endpoint == "" {
		return
	}
	up, err := net.Dial("tcp", endpoint)
	if err != nil {
		return
	}
	defer up.Close()
	v.mu.Lock()
	v.open[endpoint]++
	v.mu.Unlock()
	defer func() {
		v.mu.Lock()
		v.open[endpoint]--
		v.mu.Unlock()
	}()
	stop := make(chan struct{})
	go func() {
		select {
		case <-v.closed:
			c.Close()
			up.Close()
		case <-stop:
		}
	}()
	defer close(stop)
	pipe(c, up)
}

// pipe copies a to b and b to a until both directions are done, passing
// each side's close on as a half-close, as TCP does.
func pipe(a, b net.Conn) {
	var wg sync.WaitGroup
	copyHalf := func(dst, src net.Conn) {
		defer wg.Done()
		_, err := io.Copy(dst, src)
		if cw, ok := dst.(interface{ CloseWrite() error }); ok && err == nil {
			_ = cw.CloseWrite()
		} else {
			dst.Close()
			src.Close()
		}
	}
	wg.Add(2)
	go copyHalf(a, b)
	go copyHalf(b, a)
	wg.Wait()
}
