package harness

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Command is a program running for a test in a process group of its own,
// as root or, through runuser, as another user. It keeps every line the
// program writes, so a test can wait for a log line or count them.
//
// Stop sends SIGTERM to the program itself: runuser forks it, and on
// SIGTERM gives it only 2s before SIGKILL, less than a graceful shutdown
// may take; runuser exits when the program does. What is left after 10s is
// killed with its whole process group.
type Command struct {
	Name string
	cmd  *exec.Cmd
	done chan struct{}
	err  error
	// viaRunuser: the process started is runuser, the program its child.
	viaRunuser bool

	mu      sync.Mutex
	lines   []string
	changed chan struct{} // closed and replaced at every new line
}

// StartCommand runs argv until the test ends (or Stop). name prefixes its
// log lines when $TUNNEL_TEST_LOG is set.
func StartCommand(t T, name string, argv []string, env ...string) *Command {
	t.Helper()
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = append(os.Environ(), env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting %s: %v", name, err)
	}
	c := &Command{Name: name, cmd: cmd, done: make(chan struct{}), changed: make(chan struct{}),
		viaRunuser: filepath.Base(argv[0]) == "runuser"}
	go func() {
		s := bufio.NewScanner(out)
		s.Buffer(make([]byte, 64*1024), 1024*1024)
		for s.Scan() {
			if os.Getenv("TUNNEL_TEST_LOG") != "" {
				fmt.Fprintf(os.Stderr, "%s: %s\n", name, s.Text())
			}
			c.mu.Lock()
			c.lines = append(c.lines, s.Text())
			close(c.changed)
			c.changed = make(chan struct{})
			c.mu.Unlock()
		}
		_, _ = io.Copy(io.Discard, out)
		c.err = cmd.Wait()
		close(c.done)
	}()
	t.Cleanup(func() { _ = c.Stop() })
	return c
}

// Done is closed when the program has exited.
func (c *Command) Done() <-chan struct{} { return c.done }

// Err is how the program exited; valid after Done.
func (c *Command) Err() error { return c.err }

// Stop sends SIGTERM to the program and waits for it to exit; after 10s it
// kills the program's process group. It returns how the program exited.
func (c *Command) Stop() error {
	pgid := c.cmd.Process.Pid
	select {
	case <-c.done:
	default:
		targets := []int{pgid}
		if c.viaRunuser {
			if kids := children(pgid); len(kids) > 0 {
				targets = kids
			}
		}
		for _, pid := range targets {
			_ = syscall.Kill(pid, syscall.SIGTERM)
		}
		select {
		case <-c.done:
		case <-time.After(10 * time.Second):
			_ = syscall.Kill(-pgid, syscall.SIGKILL)
			<-c.done
		}
	}
	// The group leader is gone; anything it left in its group goes too.
	if err := syscall.Kill(-pgid, 0); !errors.Is(err, syscall.ESRCH) {
		_ = syscall.Kill(-pgid, syscall.SIGKILL)
	}
	return c.err
}

// children are the processes whose parent is pid.
func children(pid int) []int {
	entries, _ := os.ReadDir("/proc")
	var kids []int
	for _, e := range entries {
		child, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...; comm may hold spaces and parentheses.
		i := strings.LastIndexByte(string(stat), ')')
		if i < 0 {
			continue
		}
		fields := strings.Fields(string(stat[i+1:]))
		if len(fields) > 1 && fields[1] == strconv.Itoa(pid) {
			kids = append(kids, child)
		}
	}
	return kids
}

// Output is everything the program wrote so far.
func (c *Command) Output() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return strings.Join(c.lines, "\n")
}

// Count is the number of lines so far that match re.
func (c *Command) Count(re *regexp.Regexp) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, l := range c.lines {
		if re.MatchString(l) {
			n++
		}
	}
	return n
}

// WaitFor waits up to timeout for a line that matches re, from the start of
// the output, and returns its submatches. It fails the test if the program
// exits or the time runs out first.
func (c *Command) WaitFor(t T, re *regexp.Regexp, timeout time.Duration) []string {
	t.Helper()
	m, err := c.waitFor(re, timeout)
	if err != nil {
		t.Fatalf("%s: %v; its output:\n%s", c.Name, err, c.Output())
	}
	return m
}

func (c *Command) waitFor(re *regexp.Regexp, timeout time.Duration) ([]string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	seen := 0
	for {
		c.mu.Lock()
		lines, changed := c.lines[seen:], c.changed
		seen = len(c.lines)
		c.mu.Unlock()
		for _, l := range lines {
			if m := re.FindStringSubmatch(l); m != nil {
				return m, nil
			}
		}
		select {
		case <-changed:
		case <-c.done:
			// Lines written before the exit are all in by now.
			c.mu.Lock()
			rest := c.lines[seen:]
			c.mu.Unlock()
			for _, l := range rest {
				if m := re.FindStringSubmatch(l); m != nil {
					return m, nil
				}
			}
			return nil, fmt.Errorf("exited (%v) before writing a line matching %q", c.err, re)
		case <-ctx.Done():
			return nil, fmt.Errorf("no line matching %q within %v", re, timeout)
		}
	}
}

// Wait waits up to timeout for the program to exit by itself and returns
// how it exited.
func (c *Command) Wait(t T, timeout time.Duration) error {
	t.Helper()
	select {
	case <-c.done:
		return c.err
	case <-time.After(timeout):
		t.Fatalf("%s did not exit within %v; its output:\n%s", c.Name, timeout, c.Output())
		return nil
	}
}
