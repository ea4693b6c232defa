package harness

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/kcp-dev/tunnel-broker/internal/devca"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
)

var (
	buildOnce sync.Once
	binDir    string
	buildErr  error
)

// Binaries returns a folder holding the built broker, syncer-agent and
// tunnelctl. It uses $TUNNEL_BIN_DIR when set (make builds there), else
// builds them once per test process into a folder of this checkout's own in
// the temp dir, reused by later runs (go build replaces each binary in one
// rename, so test processes that build at once do not trip each other).
func Binaries(t T) string {
	t.Helper()
	buildOnce.Do(func() {
		if dir := os.Getenv("TUNNEL_BIN_DIR"); dir != "" {
			binDir = dir
			return
		}
		out, err := exec.Command("go", "env", "GOWORK").Output()
		if err != nil {
			buildErr = fmt.Errorf("go env GOWORK: %v", err)
			return
		}
		sum := sha256.Sum256(bytes.TrimSpace(out))
		binDir = filepath.Join(os.TempDir(), fmt.Sprintf("kcp-tunnel-bin-%x", sum[:6]))
		if buildErr = os.MkdirAll(binDir, 0o755); buildErr != nil {
			return
		}
		cmd := exec.Command("go", "build", "-ldflags", stampFlags(t), "-o", binDir+"/",
			"github.com/kcp-dev/tunnel-broker/broker", "github.com/kcp-dev/tunnel-broker/syncer-agent",
			"github.com/kcp-dev/tunnel-broker/broker/cmd/tunnelctl")
		out, err = cmd.CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("building binaries: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binDir
}

// Process is a broker or agent binary running for a test.
type Process struct {
	Cmd  *exec.Cmd
	done chan struct{}
	err  error

	metricsOnce sync.Once
	metrics     chan string // receives the /metrics endpoint's address once

	log processLog
}

// MetricsAddr is the address of the process's /metrics, /healthz and /readyz.
func (p *Process) MetricsAddr(t T) string {
	t.Helper()
	select {
	case addr := <-p.metrics:
		p.metrics <- addr // keep it for the next caller
		return addr
	case <-time.After(20 * time.Second):
		t.Fatal("the process did not report its metrics address")
		return ""
	}
}

// ReadyNow reports whether the process's /readyz answers 200, without
// failing the test if it does not answer at all (it may be exiting).
func (p *Process) ReadyNow() bool {
	var addr string
	select {
	case addr = <-p.metrics:
		p.metrics <- addr // keep it for the next caller
	default:
		return false
	}
	client := http.Client{Timeout: time.Second}
	resp, err := client.Get("http://" + addr + "/readyz")
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// Ready reports whether the process's /readyz answers 200.
func (p *Process) Ready(t T) bool {
	resp, err := http.Get("http://" + p.MetricsAddr(t) + "/readyz")
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// The address in a text line (address=...) or a JSON one (--log-json).
var metricsRE = regexp.MustCompile(`HTTP endpoint serving"?(?: address=|,"address":")([^\s"]+)`)

// Scrape reads one sample of p's /metrics endpoint, series with its labels
// as Prometheus prints them; ok is false if it is absent.
func Scrape(t T, p *Process, series string) (value float64, ok bool) {
	t.Helper()
	resp, err := http.Get("http://" + p.MetricsAddr(t) + "/metrics")
	if err != nil {
		t.Fatalf("scraping: %v", err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(series) + ` (\S+)$`).FindSubmatch(body)
	if m == nil {
		return 0, false
	}
	v, err := strconv.ParseFloat(string(m[1]), 64)
	if err != nil {
		t.Fatalf("%s: %v", series, err)
	}
	return v, true
}

// Stop sends SIGTERM and waits for the process to exit.
func (p *Process) Stop() error {
	select {
	case <-p.done:
		return p.err
	default:
	}
	_ = p.Cmd.Process.Signal(os.Interrupt)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		_ = p.Cmd.Process.Kill()
		<-p.done
	}
	return p.err
}

// Done is closed when the process has exited.
func (p *Process) Done() <-chan struct{} { return p.done }

// Kill ends the process abruptly, as a crash would.
func (p *Process) Kill() {
	_ = p.Cmd.Process.Kill()
	<-p.done
}

// start runs a binary, copying its log to the test log and to lines.
func start(t T, name string, args []string, lines chan<- string) *Process {
	t.Helper()
	cmd := exec.Command(filepath.Join(Binaries(t), name), args...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout = cmd.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &Process{Cmd: cmd, done: make(chan struct{}), metrics: make(chan string, 1)}
	logged := make(chan struct{})
	go func() {
		defer close(logged)
		s := bufio.NewScanner(stderr)
		for s.Scan() {
			if os.Getenv("TUNNEL_TEST_LOG") != "" {
				fmt.Fprintf(os.Stderr, "%s: %s\n", name, s.Text())
			}
			p.log.add(s.Text())
			if m := metricsRE.FindStringSubmatch(s.Text()); m != nil {
				p.metricsOnce.Do(func() { p.metrics <- m[1] })
			}
			if lines != nil {
				select {
				case lines <- s.Text():
				default:
				}
			}
		}
		_, _ = io.Copy(io.Discard, stderr)
	}()
	go func() {
		<-logged
		p.err = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() { _ = p.Stop() })
	return p
}

var servingRE = regexp.MustCompile(`broker serving"?(?: address=|,"address":")([^\s"]+)`)

// StartBrokerProcess runs the broker binary on a loopback port with the
// broker's SVID files and returns it with its address.
func (e *Env) StartBrokerProcess(extra ...string) (*Process, string) {
	e.T.Helper()
	f := e.SVID("/broker")
	lines := make(chan string, 100)
	args := append([]string{"--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--policy", e.WritePolicy(nil),
		"--svid-cert", f.Cert, "--svid-key", f.Key, "--trust-bundle", f.Bundle}, extra...)
	p := start(e.T, "broker", args, lines)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for {
		select {
		case line := <-lines:
			if m := servingRE.FindStringSubmatch(line); m != nil {
				return p, m[1]
			}
		case <-p.done:
			e.T.Fatalf("broker exited: %v", p.err)
		case <-ctx.Done():
			e.T.Fatal("broker did not start serving within 20s")
		}
	}
}

// StartAgentProcess runs the syncer-agent binary with identity path and the
// static services, and waits until it has registered with the broker.
func (e *Env) StartAgentProcess(brokerAddr, path string, services lookup.StaticFile, extra ...string) *Process {
	e.T.Helper()
	p := e.RunAgentProcess(brokerAddr, filepath.Base(path), e.SVID(path), services, extra...)
	e.waitAgentReady(p)
	return p
}

// StartPlainAgentProcess runs the syncer-agent binary with identity path in
// plain mode, serving logical cluster cluster from the physical cluster of
// kubeconfig, and waits until it has registered with the broker.
func (e *Env) StartPlainAgentProcess(brokerAddr, path, kubeconfig, cluster string) *Process {
	e.T.Helper()
	f := e.SVID(path)
	p := start(e.T, "syncer-agent", []string{"--broker", brokerAddr, "--metrics-listen", "127.0.0.1:0", "--name", filepath.Base(path),
		"--kubeconfig", kubeconfig, "--plain-cluster", cluster,
		"--svid-cert", f.Cert, "--svid-key", f.Key, "--trust-bundle", f.Bundle}, nil)
	e.waitAgentReady(p)
	return p
}

// waitAgentReady waits until the agent p is ready: registered with every
// broker replica it was given.
func (e *Env) waitAgentReady(p *Process) {
	e.T.Helper()
	Eventually(e.T, 20*time.Second, "the agent to be ready", func() bool {
		select {
		case <-p.done:
			e.T.Fatalf("agent exited: %v", p.err)
		default:
		}
		return p.Ready(e.T)
	})
}

// RunAgentProcess runs the syncer-agent binary named name with the SVID
// files f and the static services, and returns at once.
func (e *Env) RunAgentProcess(brokerAddr, name string, f devca.Files, services lookup.StaticFile, extra ...string) *Process {
	e.T.Helper()
	raw, err := yaml.Marshal(services)
	if err != nil {
		e.T.Fatal(err)
	}
	servicesFile := filepath.Join(f.Dir, "services.yaml")
	must(e.T, os.WriteFile(servicesFile, raw, 0o600))
	args := append([]string{"--broker", brokerAddr, "--metrics-listen", "127.0.0.1:0", "--name", name, "--services", servicesFile,
		"--svid-cert", f.Cert, "--svid-key", f.Key, "--trust-bundle", f.Bundle}, extra...)
	return start(e.T, "syncer-agent", args, nil)
}

// StartProcess runs one of the binaries with args, as a person would, and
// returns at once; its log is kept (Logged, WaitLogged).
func StartProcess(t T, name string, args ...string) *Process {
	t.Helper()
	return start(t, name, args, nil)
}

// Exited waits up to timeout for the process to exit and returns how it
// ended; it fails the test if the process is still running then.
func (p *Process) Exited(t T, timeout time.Duration) error {
	t.Helper()
	select {
	case <-p.done:
		return p.err
	case <-time.After(timeout):
		t.Fatalf("the process still runs after %v", timeout)
		return nil
	}
}

// Output is everything the process has logged (both its streams), one
// line after the other.
func (p *Process) Output() string {
	return strings.Join(p.Logged(), "\n")
}
