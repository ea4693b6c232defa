package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/kcp-dev/tunnel-broker/test/bench"
)

// idleWorkers is how many tunnels are being opened at once.
const idleWorkers = 64

// settle is how long the processes get before a reading.
const settle = 2 * time.Second

// idleTunnels opens each of cfg.idle tunnels through a fresh broker and
// agent (so that earlier phases' heaps do not hide the growth), each after
// one 64-byte round trip, and reports what one idle tunnel costs: the
// growth of the processes' resident memory (VmRSS of /proc/<pid>/status) and
// of their goroutines (read from their pprof endpoints, when the binaries
// have --pprof-listen), divided by the number of tunnels, and the broker's
// threads.
func (r *runner) idleTunnels(ctx context.Context) {
	for _, n := range r.cfg.idle {
		r.idle(ctx, n)
	}
}

type reading struct {
	status     bench.ProcStatus
	goroutines int             // -1 without pprof
	memory     *bench.GoMemory // nil without pprof
}

func (r *runner) read(ctx context.Context, pid int, pprof string) reading {
	st, err := bench.ReadProcStatus(pid)
	if err != nil {
		r.m.Fatal(err)
	}
	g := -1
	if pprof != "" {
		if g, err = bench.Goroutines(ctx, pprof); err != nil {
			r.logf("goroutines: %v", err)
			g = -1
		}
	}
	rd := reading{status: st, goroutines: g}
	if pprof != "" {
		if m, err := bench.ReadGoMemory(ctx, pprof); err != nil {
			r.logf("memory: %v", err)
		} else {
			rd.memory = &m
		}
	}
	return rd
}

func (r *runner) idle(ctx context.Context, n int) {
	p := r.startPair()
	defer p.stop()
	path := p.tunneled()
	// Warm up: the first tunnel pays for lazy setup (TLS, HTTP/2, pools).
	r.dialOrFatal(ctx, path, svcIdle).Close()
	time.Sleep(settle)
	brokerPID, agentPID := p.broker.Cmd.Process.Pid, p.agent.Cmd.Process.Pid
	b0, a0 := r.read(ctx, brokerPID, p.brokerPprof), r.read(ctx, agentPID, p.agentPprof)

	conns := make([]net.Conn, 0, n)
	var mu sync.Mutex
	var firstErr error
	work := make(chan struct{})
	var wg sync.WaitGroup
	ctx2, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	start := time.Now()
	for range idleWorkers {
		wg.Go(func() {
			msg, buf := make([]byte, msgSize), make([]byte, msgSize)
			for range work {
				c, err := path.dial(ctx2, svcIdle)
				if err == nil {
					_ = c.SetDeadline(time.Now().Add(30 * time.Second))
					err = bench.RoundTrip(c, msg, buf)
					_ = c.SetDeadline(time.Time{})
				}
				mu.Lock()
				if err != nil && firstErr == nil {
					firstErr = err
				}
				if c != nil {
					conns = append(conns, c)
				}
				mu.Unlock()
			}
		})
	}
	for i := 0; i < n && ctx2.Err() == nil; i++ {
		mu.Lock()
		failed := firstErr != nil
		mu.Unlock()
		if failed {
			break
		}
		work <- struct{}{}
	}
	close(work)
	wg.Wait()
	took := time.Since(start)
	opened := len(conns)
	if firstErr != nil {
		r.logf("idle %d: opened %d tunnels, then: %v", n, opened, firstErr)
	}
	r.logf("idle %d: opened %d tunnels in %v; the target holds %d connections", n, opened, took.Round(time.Millisecond), r.targets[svcIdle].Open())
	time.Sleep(settle)
	b1, a1 := r.read(ctx, brokerPID, p.brokerPprof), r.read(ctx, agentPID, p.agentPprof)
	r.saveIdleProfiles(ctx, p, n)

	for _, c := range conns {
		c.Close()
	}
	r.targets[svcIdle].CloseConns()

	if opened == 0 {
		return
	}
	name := fmt.Sprintf("idle_%d_", n)
	if opened != n {
		name = fmt.Sprintf("idle_%d_of_%d_", opened, n)
	}
	per := func(before, after int64) float64 { return float64(after-before) / float64(opened) }
	r.report.row(name+"broker_rss_KiB_per_tunnel", none, per(b0.status.RSSKiB, b1.status.RSSKiB))
	if b0.goroutines >= 0 && b1.goroutines >= 0 {
		r.report.row(name+"broker_goroutines_per_tunnel", none, per(int64(b0.goroutines), int64(b1.goroutines)))
	}
	if b0.memory != nil && b1.memory != nil {
		// Where the resident memory goes, as the Go runtime counts it.
		r.report.row(name+"broker_go_heap_KiB_per_tunnel", none, per(b0.memory.HeapInuse>>10, b1.memory.HeapInuse>>10))
		r.report.row(name+"broker_go_stacks_KiB_per_tunnel", none, per(b0.memory.StackInuse>>10, b1.memory.StackInuse>>10))
	}
	r.report.row(name+"broker_threads", none, float64(b1.status.Threads))
	r.report.row(name+"agent_rss_KiB_per_tunnel", none, per(a0.status.RSSKiB, a1.status.RSSKiB))
	if a0.goroutines >= 0 && a1.goroutines >= 0 {
		r.report.row(name+"agent_goroutines_per_tunnel", none, per(int64(a0.goroutines), int64(a1.goroutines)))
	}
	r.report.row(name+"dials_per_s_64_at_once", none, float64(opened)/took.Seconds())
}

// saveIdleProfiles saves the processes' heap and goroutine profiles with n
// tunnels open, when -profile-dir is set and the binaries serve pprof.
func (r *runner) saveIdleProfiles(ctx context.Context, p *pair, n int) {
	if r.cfg.profileDir == "" || !r.pprof {
		return
	}
	if err := os.MkdirAll(r.cfg.profileDir, 0o755); err != nil {
		r.logf("profiles: %v", err)
		return
	}
	for proc, addr := range map[string]string{"broker": p.brokerPprof, "agent": p.agentPprof} {
		for profile, file := range map[string]string{
			"heap":              "heap.pprof",
			"goroutine?debug=1": "goroutines.txt",
		} {
			path := filepath.Join(r.cfg.profileDir, fmt.Sprintf("%s-idle-%d.%s", proc, n, file))
			if err := bench.FetchProfile(ctx, addr, profile, path); err != nil {
				r.logf("profile %s: %v", path, err)
			}
		}
	}
}
