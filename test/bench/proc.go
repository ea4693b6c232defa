package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"
)

// ProcStatus is what /proc/<pid>/status says about a process's size.
type ProcStatus struct {
	RSSKiB  int64 // VmRSS
	Threads int64
}

// ReadProcStatus reads /proc/<pid>/status.
func ReadProcStatus(pid int) (ProcStatus, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return ProcStatus{}, err
	}
	defer f.Close()
	var st ProcStatus
	s := bufio.NewScanner(f)
	for s.Scan() {
		key, val, ok := strings.Cut(s.Text(), ":")
		if !ok {
			continue
		}
		fields := strings.Fields(val)
		if len(fields) == 0 {
			continue
		}
		n, err := strconv.ParseInt(fields[0], 10, 64)
		if err != nil {
			continue
		}
		switch key {
		case "VmRSS":
			st.RSSKiB = n
		case "Threads":
			st.Threads = n
		}
	}
	return st, s.Err()
}

// Goroutines reads the goroutine count of a process serving net/http/pprof
// at addr: the first line of /debug/pprof/goroutine?debug=1 is
// "goroutine profile: total N".
func Goroutines(ctx context.Context, addr string) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/debug/pprof/goroutine?debug=1", nil)
	if err != nil {
		return 0, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("goroutine profile: %s", resp.Status)
	}
	line, err := bufio.NewReader(io.LimitReader(resp.Body, 4096)).ReadString('\n')
	if err != nil {
		return 0, fmt.Errorf("goroutine profile: %w", err)
	}
	_, total, ok := strings.Cut(strings.TrimSpace(line), "total ")
	if !ok {
		return 0, fmt.Errorf("goroutine profile: unexpected first line %q", line)
	}
	return strconv.Atoi(total)
}

// GoMemory is what a Go process holds in its heap and in goroutine stacks,
// in bytes, as its runtime counts them (MemStats.HeapInuse, StackInuse).
type GoMemory struct{ HeapInuse, StackInuse int64 }

// ReadGoMemory reads GoMemory of a process serving net/http/pprof at addr:
// /debug/pprof/heap?debug=1 ends with the runtime's MemStats, one
// "# Name = value" line each ("# Stack = inuse / sys" for the stacks).
func ReadGoMemory(ctx context.Context, addr string) (GoMemory, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/debug/pprof/heap?debug=1", nil)
	if err != nil {
		return GoMemory{}, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return GoMemory{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return GoMemory{}, fmt.Errorf("heap profile: %s", resp.Status)
	}
	var m GoMemory
	found := 0
	s := bufio.NewScanner(resp.Body)
	s.Buffer(make([]byte, 64<<10), 1<<20)
	for s.Scan() {
		name, value, ok := strings.Cut(strings.TrimPrefix(s.Text(), "# "), " = ")
		var field *int64
		switch {
		case !ok:
			continue
		case name == "HeapInuse":
			field = &m.HeapInuse
		case name == "Stack":
			field = &m.StackInuse
			value, _, _ = strings.Cut(value, " / ")
		default:
			continue
		}
		if *field, err = strconv.ParseInt(value, 10, 64); err != nil {
			return GoMemory{}, fmt.Errorf("heap profile: %s: %w", name, err)
		}
		found++
	}
	if err := s.Err(); err != nil {
		return GoMemory{}, fmt.Errorf("heap profile: %w", err)
	}
	if found != 2 {
		return GoMemory{}, errors.New("heap profile: no HeapInuse and Stack lines")
	}
	return m, nil
}

// FetchProfile saves a pprof profile (e.g. "profile?seconds=10", "heap")
// from a process serving net/http/pprof at addr into path.
func FetchProfile(ctx context.Context, addr, profile, path string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/debug/pprof/"+profile, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", profile, resp.Status)
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// clockTick is the unit of /proc/<pid>/stat's times: USER_HZ, 100 on Linux.
const clockTick = 10 * time.Millisecond

// ProcCPU is the CPU time (user and system) a process has used so far,
// from /proc/<pid>/stat, in steps of 10ms.
func ProcCPU(pid int) (time.Duration, error) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// The command name, in parentheses, may hold spaces: fields count
	// from after it. utime and stime are fields 14 and 15 of the line.
	i := strings.LastIndexByte(string(raw), ')')
	if i < 0 {
		return 0, fmt.Errorf("/proc/%d/stat: unexpected format", pid)
	}
	f := strings.Fields(string(raw[i+1:]))
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc/%d/stat: unexpected format", pid)
	}
	var ticks int64
	for _, s := range f[11:13] {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("/proc/%d/stat: %w", pid, err)
		}
		ticks += n
	}
	return time.Duration(ticks) * clockTick, nil
}

// Usage is what this process holds after a garbage collection, which also
// shrinks the stacks that use less than a quarter of theirs: Go heap and
// stack bytes in use, and goroutines.
type Usage struct {
	Heap, Stacks uint64
	Goroutines   int
}

// ReadUsage collects garbage and reads this process's Usage.
func ReadUsage() Usage {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return Usage{Heap: m.HeapInuse, Stacks: m.StackInuse, Goroutines: runtime.NumGoroutine()}
}
