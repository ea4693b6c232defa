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
// threads. With the peer, the same through a fresh remotedialer server and
// client each time (peeridle.go).
func (r *runner) idleTunnels(ctx context.Context) {
	for _, n := range r.cfg.idle {
		r.idle(ctx, n)
		if r.cfg.peerBin != "" {
			r.peerIdle(ctx, n)
		}
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

// middleProc is a process between the caller and the target, whose growth
// the idle figures measure.
type middleProc struct {
	name  string // in the rows: broker, agent, server, client
	pid   int
	pprof string // "" without pprof
}

// idleRun is what holding idle tunnels found.
type idleRun struct {
	conns         []net.Conn // the tunnels, for the caller to close
	before, after []reading  // of each middle process
	took          time.Duration
}

// holdIdle opens n tunnels on p to svc, idleWorkers at a time, each after
// one 64-byte round trip, and reads procs before (after a warm-up tunnel and
// settle) and after (after settle again). It stops opening at the first
// failure, which it logs.
func (r *runner) holdIdle(ctx context.Context, p path, svc string, n int, procs []middleProc) idleRun {
	// Warm up: the first tunnel pays for lazy setup (TLS, HTTP/2, pools).
	r.dialOrFatal(ctx, p, svc).Close()
	time.Sleep(settle)
	var run idleRun
	for _, proc := range procs {
		run.before = append(run.before, r.read(ctx, proc.pid, proc.pprof))
	}

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
				c, err := p.dial(ctx2, svc)
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
	run.took = time.Since(start)
	run.conns = conns
	if firstErr != nil {
		r.logf("%s idle %d: opened %d tunnels, then: %v", p.name, n, len(conns), firstErr)
	}
	time.Sleep(settle)
	for _, proc := range procs {
		run.after = append(run.after, r.read(ctx, proc.pid, proc.pprof))
	}
	return run
}

// idleRows reports a run of n idle tunnels with row, per tunnel opened:
// each middle process's RSS and goroutines, for the first (the one facing
// the caller) also its Go heap and stacks and its threads, then the middle
// processes' RSS together and the rate the tunnels opened at.
func idleRows(row func(name string, value float64), n int, procs []middleProc, run idleRun) {
	opened := len(run.conns)
	if opened == 0 {
		return
	}
	name := fmt.Sprintf("idle_%d_", n)
	if opened != n {
		name = fmt.Sprintf("idle_%d_of_%d_", opened, n)
	}
	per := func(before, after int64) float64 { return float64(after-before) / float64(opened) }
	var rss int64
	for i, proc := range procs {
		b, a := run.before[i], run.after[i]
		rss += a.status.RSSKiB - b.status.RSSKiB
		row(name+proc.name+"_rss_KiB_per_tunnel", per(b.status.RSSKiB, a.status.RSSKiB))
		if b.goroutines >= 0 && a.goroutines >= 0 {
			row(name+proc.name+"_goroutines_per_tunnel", per(int64(b.goroutines), int64(a.goroutines)))
		}
		if i > 0 {
			continue
		}
		if b.memory != nil && a.memory != nil {
			// Where the resident memory goes, as the Go runtime counts it.
			row(name+proc.name+"_go_heap_KiB_per_tunnel", per(b.memory.HeapInuse>>10, a.memory.HeapInuse>>10))
			row(name+proc.name+"_go_stacks_KiB_per_tunnel", per(b.memory.StackInuse>>10, a.memory.StackInuse>>10))
		}
		row(name+proc.name+"_threads", float64(a.status.Threads))
	}
	row(name+"middle_rss_KiB_per_tunnel", per(0, rss))
	row(name+"dials_per_s_64_at_once", float64(opened)/run.took.Seconds())
}

func (r *runner) idle(ctx context.Context, n int) {
	p := r.startPair()
	defer p.stop()
	procs := []middleProc{
		{"broker", p.broker.Cmd.Process.Pid, p.brokerPprof},
		{"agent", p.agent.Cmd.Process.Pid, p.agentPprof},
	}
	run := r.holdIdle(ctx, p.tunneled(), svcIdle, n, procs)
	r.logf("idle %d: opened %d tunnels in %v; the target holds %d connections", n, len(run.conns), run.took.Round(time.Millisecond), r.targets[svcIdle].Open())
	r.saveIdleProfiles(ctx, p, n)
	for _, c := range run.conns {
		c.Close()
	}
	r.targets[svcIdle].CloseConns()
	idleRows(func(name string, v float64) { r.report.row(name, none, v) }, n, procs, run)
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
