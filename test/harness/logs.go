package harness

import (
	"strings"
	"sync"
	"time"
)

// maxLogLines bounds what a process's log keeps for tests: the latest lines.
const maxLogLines = 10000

// processLog keeps the latest lines a process logged.
type processLog struct {
	mu    sync.Mutex
	lines []string
}

func (l *processLog) add(line string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.lines) == maxLogLines {
		l.lines = append(l.lines[:0], l.lines[maxLogLines/2:]...)
	}
	l.lines = append(l.lines, line)
}

// Logged returns the lines the process logged that contain every one of
// parts.
func (p *Process) Logged(parts ...string) []string {
	p.log.mu.Lock()
	defer p.log.mu.Unlock()
	var out []string
next:
	for _, line := range p.log.lines {
		for _, part := range parts {
			if !strings.Contains(line, part) {
				continue next
			}
		}
		out = append(out, line)
	}
	return out
}

// WaitLogged waits until the process has logged at least n lines that
// contain every one of parts, and returns them.
func (p *Process) WaitLogged(t T, n int, parts ...string) []string {
	t.Helper()
	var lines []string
	Eventually(t, 20*time.Second, "the log to show "+strings.Join(parts, " ... "), func() bool {
		lines = p.Logged(parts...)
		return len(lines) >= n
	})
	return lines
}
