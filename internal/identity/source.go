package identity

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
)

// Source is a workload's identity, whichever way it is obtained.
type Source interface {
	SVIDSource
	Close() error
}

// Options choose where the identity comes from: the Workload API (a socket)
// or SVID files. They map to the same flags on every binary.
type Options struct {
	// Socket is the Workload API address, e.g. unix:///run/spire/agent.sock;
	// empty means $SPIFFE_ENDPOINT_SOCKET when Files are not given.
	Socket string
	Files  Files
	// Reload is how often SVID files are re-read.
	Reload time.Duration
	// WorkloadAPITimeout bounds the wait for the first SVID from the
	// Workload API (DefaultWorkloadAPITimeout if not positive).
	WorkloadAPITimeout time.Duration
}

// Validate refuses option values no identity can come from, naming the flag.
func (o Options) Validate() error {
	if o.Reload < 0 {
		return fmt.Errorf("--svid-reload-interval %v: must not be negative", o.Reload)
	}
	if o.WorkloadAPITimeout < 0 {
		return fmt.Errorf("%s %v: must not be negative", flagTimeout, o.WorkloadAPITimeout)
	}
	return nil
}

// Open returns the identity the options name. With the Workload API it waits
// until the first SVID arrives, WorkloadAPITimeout passes or ctx ends.
func Open(ctx context.Context, o Options, log *slog.Logger) (Source, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	files := o.Files.Cert != "" || o.Files.Key != "" || o.Files.Bundle != ""
	if files && o.Socket != "" {
		return nil, fmt.Errorf("give either a Workload API socket (%s) or SVID files (%s, %s, %s), not both", flagSocket, flagCert, flagKey, flagBundle)
	}
	if files {
		return openFiles(o, log)
	}
	return openWorkloadAPI(ctx, o, log)
}

func openFiles(o Options, log *slog.Logger) (Source, error) {
	if o.Files.Cert == "" || o.Files.Key == "" || o.Files.Bundle == "" {
		return nil, fmt.Errorf("SVID files need all of %s, %s and %s", flagCert, flagKey, flagBundle)
	}
	if err := checkFiles(o.Files); err != nil {
		return nil, err
	}
	s, err := LoadFiles(o.Files, log)
	if err != nil {
		return nil, err
	}
	reload := o.Reload
	if reload <= 0 {
		reload = 5 * time.Second
	}
	s.Watch(reload)
	return s, nil
}

// OpenWithID opens the identity the options name, as Open does, and returns
// the SPIFFE ID it presents too: the process's own ID.
func OpenWithID(ctx context.Context, o Options, log *slog.Logger) (Source, spiffeid.ID, error) {
	src, err := Open(ctx, o, log)
	if err != nil {
		return nil, spiffeid.ID{}, err
	}
	self, err := IDOf(src)
	if err != nil {
		src.Close()
		return nil, spiffeid.ID{}, err
	}
	return src, self, nil
}

// IDOf is the SPIFFE ID a source currently presents.
func IDOf(s SVIDSource) (spiffeid.ID, error) {
	svid, err := s.GetX509SVID()
	if err != nil {
		return spiffeid.ID{}, err
	}
	return svid.ID, nil
}

// ParseFederated reads repeated td=path flags into Files.Federated.
func ParseFederated(values []string) (map[string]string, error) {
	out := map[string]string{}
	for _, v := range values {
		td, path, ok := strings.Cut(v, "=")
		if !ok || td == "" || path == "" {
			return nil, fmt.Errorf("federated bundle %q: want TRUST_DOMAIN=PATH", v)
		}
		out[td] = path
	}
	return out, nil
}

func sortedKeys(m map[string]string) []string {
	return slices.Sorted(maps.Keys(m))
}
