package main

import (
	"bufio"
	"io"
	"os"
	"os/exec"
	"strings"
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
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		m.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		m.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		m.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	m.Cleanup(func() {
		stdin.Close()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	})
	lines := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(stdout).ReadString('\n')
		lines <- strings.TrimSpace(strings.TrimPrefix(line, "listening "))
		_, _ = io.Copy(io.Discard, stdout)
	}()
	select {
	case a := <-lines:
		if a == "" {
			m.Fatalf("%s process did not start", role)
		}
		return a, cmd.Process.Pid
	case <-time.After(20 * time.Second):
		m.Fatalf("%s process did not start within 20s", role)
		return "", 0
	}
}
