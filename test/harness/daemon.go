package harness

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"time"
)

// Daemon is a server process (etcd, kube-apiserver, kcp) whose output goes
// to a log file.
type Daemon struct {
	cmd     *exec.Cmd
	logPath string
	done    chan struct{}
	err     error
}

// StartDaemon runs bin with args, and env added to this process's
// environment, appending its output to logPath.
func StartDaemon(bin, logPath string, env []string, args ...string) (*Daemon, error) {
	log, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	if env != nil {
		cmd.Env = append(os.Environ(), env...)
	}
	cmd.Stdout, cmd.Stderr = log, log
	// If the test process dies, its servers die with it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		log.Close()
		return nil, err
	}
	d := &Daemon{cmd: cmd, logPath: logPath, done: make(chan struct{})}
	go func() {
		d.err = cmd.Wait()
		log.Close()
		close(d.done)
	}()
	return d, nil
}

// WaitReady polls ready until it succeeds, the process exits, or limit
// passes (a bound for a broken setup), and stops the process if it is not
// ready by then.
func (d *Daemon) WaitReady(name string, limit time.Duration, ready func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	var last error
	for {
		attempt, cancelAttempt := context.WithTimeout(ctx, 5*time.Second)
		last = ready(attempt)
		cancelAttempt()
		if last == nil {
			return nil
		}
		select {
		case <-d.done:
			return fmt.Errorf("%s exited: %v\n%s", name, d.err, d.LogTail())
		case <-ctx.Done():
			_ = d.Stop()
			return fmt.Errorf("%s not ready after %v: %v\n%s", name, limit, last, d.LogTail())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Stop sends SIGTERM and waits; SIGKILL if it does not exit in 30 s.
func (d *Daemon) Stop() error {
	_ = d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-d.done:
	case <-time.After(30 * time.Second):
		_ = d.cmd.Process.Kill()
		<-d.done
	}
	var exit *exec.ExitError
	if d.err != nil && !errors.As(d.err, &exit) {
		return d.err
	}
	return nil
}

// Log is everything the daemon wrote so far.
func (d *Daemon) Log() string {
	b, _ := os.ReadFile(d.logPath)
	return string(b)
}

// LogTail is the end of the log, for errors.
func (d *Daemon) LogTail() string {
	b, _ := os.ReadFile(d.logPath)
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(b)
}
