package identity

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/spiffe/go-spiffe/v2/workloadapi"
)

// DefaultWorkloadAPITimeout is how long a binary waits at start for its first
// X.509-SVID: long enough for a SPIRE agent that starts beside it, short
// enough that a pod without one crash-loops with the reason in its log.
const DefaultWorkloadAPITimeout = time.Minute

// openWorkloadAPI waits for the first X.509-SVID from the Workload API,
// saying where it waits, and gives up after o.WorkloadAPITimeout with the
// last error the Workload API client met.
func openWorkloadAPI(ctx context.Context, o Options, log *slog.Logger) (Source, error) {
	addr := o.Socket
	if addr == "" {
		env, ok := workloadapi.GetDefaultAddress()
		if !ok {
			return nil, fmt.Errorf("no identity: give SVID files (%s, %s, %s), a Workload API socket (%s), or set %s",
				flagCert, flagKey, flagBundle, flagSocket, workloadapi.SocketEnv)
		}
		addr = env
	}
	timeout := o.WorkloadAPITimeout
	if timeout <= 0 {
		timeout = DefaultWorkloadAPITimeout
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log.Info("waiting for an X.509-SVID from the SPIFFE Workload API", "address", addr, "timeout", timeout.String())
	wait, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	errs := &workloadAPILog{log: log.With("address", addr)}
	src, err := workloadapi.NewX509Source(wait, workloadapi.WithClientOptions(workloadapi.WithAddr(addr), workloadapi.WithLogger(errs)))
	switch {
	case err == nil:
		return src, nil
	case ctx.Err() != nil:
		return nil, fmt.Errorf("stopped while waiting for an X.509-SVID from the Workload API at %s", addr)
	case errors.Is(err, context.DeadlineExceeded):
		return nil, fmt.Errorf("no X.509-SVID from the Workload API at %s within %v (%s): %s; is the SPIRE agent serving there, and is this workload registered?",
			addr, timeout, flagTimeout, errs.last())
	}
	return nil, fmt.Errorf("fetching an X.509-SVID from the Workload API at %s: %w", addr, err)
}

// workloadAPILog takes go-spiffe's Workload API client's log: its errors (a
// socket that is not there, a workload with no registration entry) become
// warnings, and the last one explains a wait that timed out.
type workloadAPILog struct {
	log *slog.Logger

	mu      sync.Mutex
	lastErr string
}

func (l *workloadAPILog) Debugf(format string, args ...any) {
	l.log.Debug("Workload API: " + fmt.Sprintf(format, args...))
}

func (l *workloadAPILog) Infof(format string, args ...any) {
	l.log.Info("Workload API: " + fmt.Sprintf(format, args...))
}

func (l *workloadAPILog) Warnf(format string, args ...any) {
	l.log.Warn("Workload API: " + fmt.Sprintf(format, args...))
}

func (l *workloadAPILog) Errorf(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	l.mu.Lock()
	l.lastErr = msg
	l.mu.Unlock()
	l.log.Warn("Workload API: " + msg)
}

func (l *workloadAPILog) last() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.lastErr == "" {
		return "it sent nothing"
	}
	return "last error: " + l.lastErr
}
