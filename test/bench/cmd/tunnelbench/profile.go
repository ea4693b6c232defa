package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/kcp-dev/tunnel-broker/test/bench"
)

// profile starts CPU profiles of the main pair's broker and agent for window,
// while a tunneled measurement runs; stop waits for them and then saves both
// processes' heap profiles. Without -profile-dir, or binaries without pprof,
// it does nothing.
func (r *runner) profile(ctx context.Context, name string, window time.Duration) (stop func()) {
	if r.cfg.profileDir == "" || !r.pprof {
		return func() {}
	}
	if err := os.MkdirAll(r.cfg.profileDir, 0o755); err != nil {
		r.logf("profiles: %v", err)
		return func() {}
	}
	procs := map[string]string{"broker": r.main.brokerPprof, "agent": r.main.agentPprof}
	ctx, cancel := context.WithTimeout(ctx, window+30*time.Second)
	var wg sync.WaitGroup
	seconds := max(1, int(window.Round(time.Second)/time.Second))
	for proc, addr := range procs {
		wg.Go(func() {
			path := filepath.Join(r.cfg.profileDir, fmt.Sprintf("%s-%s.cpu.pprof", proc, name))
			if err := bench.FetchProfile(ctx, addr, fmt.Sprintf("profile?seconds=%d", seconds), path); err != nil {
				r.logf("profile %s: %v", path, err)
			}
		})
	}
	return func() {
		defer cancel()
		wg.Wait()
		for proc, addr := range procs {
			path := filepath.Join(r.cfg.profileDir, fmt.Sprintf("%s-%s.heap.pprof", proc, name))
			if err := bench.FetchProfile(ctx, addr, "heap", path); err != nil {
				r.logf("profile %s: %v", path, err)
			}
		}
	}
}

// profilePath is profile for a measurement on path p: only the tunneled
// path's measurements are profiled, the others' stop does nothing.
func (r *runner) profilePath(ctx context.Context, p path, name string, window time.Duration) (stop func()) {
	if p.name != "tunneled" {
		return func() {}
	}
	return r.profile(ctx, name, window)
}
