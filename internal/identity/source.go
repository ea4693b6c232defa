package identity

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/workloadapi"
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
}

// Open returns the identity the options name. With the Workload API it waits
// until the first SVID arrives or ctx ends.
func Open(ctx context.Context, o Options, log *slog.Logger) (Source, error) {
	files := o.Files.Cert != "" || o.Files.Key != "" || o.Files.Bundle != ""
	if files && o.Socket != "" {
		return nil, errors.New("give either a Workload API socket or SVID files, not both")
	}
	if files {
		if o.Files.Cert == "" || o.Files.Key == "" || o.Files.Bundle == "" {
			return nil, errors.New("SVID files need a certificate, a key and a trust bundle")
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
	var opts []workloadapi.ClientOption
	if o.Socket != "" {
		opts = append(opts, workloadapi.WithAddr(o.Socket))
	} else if _, ok := workloadapi.GetDefaultAddress(); !ok {
		return nil, errors.New("no identity: give SVID files, a Workload API socket, or set SPIFFE_ENDPOINT_SOCKET")
	}
	src, err := workloadapi.NewX509Source(ctx, workloadapi.WithClientOptions(opts...))
	if err != nil {
		return nil, fmt.Errorf("fetching an X.509-SVID from the Workload API: %w", err)
	}
	return src, nil
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
