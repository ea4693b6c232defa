package kcpplugin

import (
	"bytes"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"
)

// logLines is a slog destination that tests read while the Dialer writes.
type logLines struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logLines) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

// waitFor waits until a line has every one of parts, and returns it.
func (l *logLines) waitFor(t *testing.T, parts ...string) string {
	t.Helper()
	deadline := time.Now().Add(waitLong)
	for {
		l.mu.Lock()
		lines := strings.Split(l.buf.String(), "\n")
		l.mu.Unlock()
		for _, line := range lines {
			if containsAll(line, parts) {
				return line
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no log line with %q in %v; the log:\n%s", parts, waitLong, strings.Join(lines, "\n"))
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func containsAll(s string, parts []string) bool {
	for _, p := range parts {
		if !strings.Contains(s, p) {
			return false
		}
	}
	return true
}

func TestTheDialerLogsWhyItHasNoSpares(t *testing.T) {
	logs := &logLines{}
	b := startDialConnBroker(t, echoTunnel)
	b.refuseAll(errOverSpares)
	d := dialerWith(t, establish((*peer).echo), WithDialConnections(DialConnections{
		Address: b.addr, TLS: b.client, Spares: 1, Log: slog.New(slog.NewTextHandler(logs, nil)),
	}))
	logs.waitFor(t, "could not open a dial connection", "address="+b.addr, "ResourceExhausted", "too many spare dial connections")
	roundTrip(t, dialTest(t, d), "on a stream meanwhile")
}

func TestTheDialerLogsASpareLostBeforeUse(t *testing.T) {
	logs := &logLines{}
	b := startDialConnBroker(t, echoTunnel)
	d := dialerWith(t, noStreams(t), WithDialConnections(DialConnections{
		Address: b.addr, TLS: b.client, Spares: 1, Log: slog.New(slog.NewTextHandler(logs, nil)),
	}))
	waitForSpares(t, d, b, 1)
	b.closeSpares()
	logs.waitFor(t, "a spare dial connection ended before use", "address="+b.addr)
}
