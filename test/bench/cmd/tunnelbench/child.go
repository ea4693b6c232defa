package main

import (
	"bufio"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"

	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// Servers that must not share this process's Go runtime (its garbage
// collector and scheduler) with the callers they are measured with run as
// children: this program again, with roleEnv naming what to serve and more
// variables saying how. A child prints "listening <addr>" and serves until
// its stdin closes, which happens when tunnelbench exits however it exits,
// so no child outlives the run.
const roleEnv = "TUNNELBENCH_ROLE"

// startChild starts this program as a child with role and env, waits for the
// address it listens on and returns it with the child's pid. The child stops
// with m's cleanups.
func startChild(m *harness.Main, role string, env ...string) (addr string, pid int) {
	self, err := os.Executable()
	if err != nil {
		m.Fatal(err)
	}
	cmd := exec.Command(self)
	cmd.Env = append(append(os.Environ(), roleEnv+"="+role), env...)
	line, pid, _ := startProcess(m, role, cmd)
	addr, ok := strings.CutPrefix(line, "listening ")
	if !ok || addr == "" {
		m.Fatalf("%s process did not start: it said %q", role, line)
	}
	return addr, pid
}

// spawn starts cmd, a child that serves until its stdin closes, and
// returns its pipes and stop, which closes its stdin and waits for it to
// exit, killing it if it has not 5s later; m's cleanups call stop too.
func spawn(m *harness.Main, cmd *exec.Cmd) (stdin io.WriteCloser, stdout io.ReadCloser, stop func()) {
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		m.Fatal(err)
	}
	stdout, err = cmd.StdoutPipe()
	if err != nil {
		m.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		m.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	stop = sync.OnceFunc(func() {
		stdin.Close()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	})
	m.Cleanup(stop)
	return stdin, stdout, stop
}

// startProcess starts cmd, which follows the children's rules (one line on
// stdout once it is ready, then serve until stdin closes), and returns that
// line, its pid and stop. stop closes its stdin and waits for it to exit,
// killing it if it has not 5s later; m's cleanups call stop too.
func startProcess(m *harness.Main, name string, cmd *exec.Cmd) (line string, pid int, stop func()) {
	_, stdout, stop := spawn(m, cmd)
	lines := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(stdout).ReadString('\n')
		lines <- strings.TrimSpace(line)
		_, _ = io.Copy(io.Discard, stdout)
	}()
	select {
	case l := <-lines:
		if l == "" {
			m.Fatalf("%s process did not start", name)
		}
		return l, cmd.Process.Pid, stop
	case <-time.After(20 * time.Second):
		m.Fatalf("%s process did not start within 20s", name)
		return "", 0, nil
	}
}
