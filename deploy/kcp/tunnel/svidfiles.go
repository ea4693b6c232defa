package tunnel

import (
	"bytes"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
)

// fileSource serves kcp's SVID and its trust domain's bundle from PEM files
// and follows their rotation. Writers such as spiffe-helper replace the
// files one after another, so a read can catch a certificate without its
// key: the files are read together and swapped in only when they parse
// together; until then the last good SVID stays in force.
//
// The broker and the agent have the same behaviour in internal/identity's
// FileSource. This module cannot import it: that package's module asks for
// the broker's gRPC and more, which would raise the versions kcp selects.
type fileSource struct {
	cert, key, bundle string
	log               logr.Logger

	mu     sync.RWMutex
	svid   *x509svid.SVID
	trust  *x509bundle.Bundle
	loaded []byte // the files' bytes, to notice a change cheaply

	stop chan struct{}
	done chan struct{}
}

// loadFiles reads the files; they must parse.
func loadFiles(cert, key, bundle string, log logr.Logger) (*fileSource, error) {
	s := &fileSource{cert: cert, key: key, bundle: bundle, log: log}
	raw, err := s.read()
	if err == nil {
		err = s.parse(raw)
	}
	if err != nil {
		return nil, fmt.Errorf("kcp's SVID files: %w", err)
	}
	return s, nil
}

// watch re-reads the files every interval until Close.
func (s *fileSource) watch(interval time.Duration) {
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
				s.reload()
			}
		}
	}()
}

// reload swaps in the files' material if it changed and parses, and
// reports whether it did.
func (s *fileSource) reload() bool {
	raw, err := s.read()
	if err != nil {
		s.log.Error(err, "SVID files unreadable, keeping kcp's current SVID")
		return false
	}
	s.mu.RLock()
	same := bytes.Equal(raw, s.loaded)
	s.mu.RUnlock()
	if same {
		return false
	}
	if err := s.parse(raw); err != nil {
		// Most likely a rotation caught half-way: the next read will do.
		s.log.Info("SVID files do not parse together yet, keeping kcp's current SVID", "error", err.Error())
		return false
	}
	svid, _ := s.GetX509SVID()
	s.log.Info("kcp's SVID reloaded", "id", svid.ID.String(), "expires", svid.Certificates[0].NotAfter)
	return true
}

func (s *fileSource) read() ([]byte, error) {
	var all bytes.Buffer
	for _, path := range []string{s.cert, s.key, s.bundle} {
		b, err := os.ReadFile(path)
		if err != nil {
			return nil, err
		}
		all.Write(b)
		all.WriteByte(0)
	}
	return all.Bytes(), nil
}

func (s *fileSource) parse(raw []byte) error {
	parts := bytes.SplitN(raw, []byte{0}, 4)
	svid, err := x509svid.Parse(parts[0], parts[1])
	if err != nil {
		return err
	}
	trust, err := x509bundle.Parse(svid.ID.TrustDomain(), parts[2])
	if err != nil {
		return fmt.Errorf("%s: %w", s.bundle, err)
	}
	s.mu.Lock()
	s.svid, s.trust, s.loaded = svid, trust, raw
	s.mu.Unlock()
	return nil
}

// GetX509SVID implements x509svid.Source.
func (s *fileSource) GetX509SVID() (*x509svid.SVID, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.svid, nil
}

// GetX509BundleForTrustDomain implements x509bundle.Source: kcp trusts its
// own trust domain only.
func (s *fileSource) GetX509BundleForTrustDomain(td spiffeid.TrustDomain) (*x509bundle.Bundle, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if td != s.trust.TrustDomain() {
		return nil, fmt.Errorf("kcp trusts no bundle of trust domain %q, only its own %q", td, s.trust.TrustDomain())
	}
	return s.trust, nil
}

// Close stops watching.
func (s *fileSource) Close() error {
	if s.stop != nil {
		close(s.stop)
		<-s.done
		s.stop = nil
	}
	return nil
}
