// Package identity gives the broker, the agent and callers their SPIFFE
// identity, from the Workload API or from SVID files, and turns it into gRPC
// transport credentials. Verification is go-spiffe's: nothing here validates
// an X.509 path by hand. The credentials verify the peer on every handshake,
// resumed ones included, admit only IDs a workload may hold, and hand every
// RPC the peer's verified ID (PeerID).
package identity

import (
	"bytes"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
)

// Files names an X.509-SVID on disk the way cert-manager's csi-driver-spiffe
// writes it: a leaf-first certificate chain, its PKCS#8 key, and the trust
// bundle of the SVID's own trust domain; plus, for federation, bundle files
// of other trust domains.
type Files struct {
	Cert   string
	Key    string
	Bundle string
	// Federated maps a trust domain name to its bundle file.
	Federated map[string]string
}

// FileSource serves an SVID and bundles from files and follows their
// rotation: csi-driver-spiffe swaps all files at once through a symlink, so
// the source re-reads them all together and swaps the material only when
// everything parses. A half-written rotation keeps the old material.
type FileSource struct {
	files Files
	log   *slog.Logger

	mu      sync.RWMutex
	svid    *x509svid.SVID
	bundles *x509bundle.Set
	raw     []byte // the files' bytes, to notice a change cheaply

	stop chan struct{}
	done chan struct{}
}

var (
	_ x509svid.Source   = (*FileSource)(nil)
	_ x509bundle.Source = (*FileSource)(nil)
)

// LoadFiles reads the files once; they must parse. Call Watch to follow
// rotations.
func LoadFiles(f Files, log *slog.Logger) (*FileSource, error) {
	if log == nil {
		log = slog.Default()
	}
	s := &FileSource{files: f, log: log}
	raw, err := s.read()
	if err != nil {
		return nil, err
	}
	if err := s.load(raw); err != nil {
		return nil, err
	}
	return s, nil
}

// Watch re-reads the files every interval until Close.
func (s *FileSource) Watch(interval time.Duration) {
	s.stop, s.done = make(chan struct{}), make(chan struct{})
	go func() {
		defer close(s.done)
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-s.stop:
				return
			case <-t.C:
				s.Reload()
			}
		}
	}()
}

// Close stops watching.
func (s *FileSource) Close() error {
	if s.stop != nil {
		close(s.stop)
		<-s.done
		s.stop = nil
	}
	return nil
}

// Reload re-reads the files and swaps the material if it changed and parses.
// It reports whether new material is in force.
func (s *FileSource) Reload() bool {
	raw, err := s.read()
	if err != nil {
		s.log.Warn("SVID files unreadable, keeping the current SVID", "error", err)
		return false
	}
	s.mu.RLock()
	same := bytes.Equal(raw, s.raw)
	s.mu.RUnlock()
	if same {
		return false
	}
	if err := s.load(raw); err != nil {
		// Most likely a rotation caught half-way: the next read will do.
		s.log.Warn("SVID files do not parse, keeping the current SVID", "error", err)
		return false
	}
	s.log.Info("SVID reloaded", "id", s.ID().String(), "expires", s.svidExpiry())
	return true
}

// read returns all files' bytes, in a fixed order, as one blob.
func (s *FileSource) read() ([]byte, error) {
	var all bytes.Buffer
	for _, path := range s.paths() {
		b, err := os.ReadFile(path)
		if err != nil {
			return nil, err
		}
		all.WriteString(path)
		all.WriteByte(0)
		all.Write(b)
		all.WriteByte(0)
	}
	return all.Bytes(), nil
}

func (s *FileSource) paths() []string {
	paths := []string{s.files.Cert, s.files.Key, s.files.Bundle}
	for _, td := range sortedKeys(s.files.Federated) {
		paths = append(paths, s.files.Federated[td])
	}
	return paths
}

// load parses every file and swaps the material in one step.
func (s *FileSource) load(raw []byte) error {
	svid, err := x509svid.Load(s.files.Cert, s.files.Key)
	if err != nil {
		return fmt.Errorf("loading SVID from %s and %s: %w", s.files.Cert, s.files.Key, err)
	}
	own, err := x509bundle.Load(svid.ID.TrustDomain(), s.files.Bundle)
	if err != nil {
		return fmt.Errorf("loading trust bundle of %s from %s: %w", svid.ID.TrustDomain(), s.files.Bundle, err)
	}
	if err := holdsCA(own.X509Authorities()); err != nil {
		return fmt.Errorf("trust bundle %s %w", s.files.Bundle, err)
	}
	set := x509bundle.NewSet(own)
	for _, name := range sortedKeys(s.files.Federated) {
		td, err := spiffeid.TrustDomainFromString(name)
		if err != nil {
			return fmt.Errorf("federated trust domain %q: %w", name, err)
		}
		b, err := x509bundle.Load(td, s.files.Federated[name])
		if err != nil {
			return fmt.Errorf("loading trust bundle of %s from %s: %w", td, s.files.Federated[name], err)
		}
		if err := holdsCA(b.X509Authorities()); err != nil {
			return fmt.Errorf("trust bundle %s %w", s.files.Federated[name], err)
		}
		set.Add(b)
	}
	s.mu.Lock()
	s.svid, s.bundles, s.raw = svid, set, raw
	s.mu.Unlock()
	return nil
}

// ID is this workload's SPIFFE ID.
func (s *FileSource) ID() spiffeid.ID {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.svid.ID
}

func (s *FileSource) svidExpiry() time.Time {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.svid.Certificates[0].NotAfter
}

// GetX509SVID implements x509svid.Source.
func (s *FileSource) GetX509SVID() (*x509svid.SVID, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.svid, nil
}

// GetX509BundleForTrustDomain implements x509bundle.Source.
func (s *FileSource) GetX509BundleForTrustDomain(td spiffeid.TrustDomain) (*x509bundle.Bundle, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.bundles.GetX509BundleForTrustDomain(td)
}
