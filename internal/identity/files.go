// Package identity gives the broker and the agent their SPIFFE identity and
// turns it into gRPC transport credentials. Verification is go-spiffe's:
// nothing here validates an X.509 path by hand.
package identity

import (
	"fmt"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
)

// Files names an X.509-SVID on disk, the way cert-manager's csi-driver-spiffe
// writes it: a leaf-first certificate chain, its PKCS#8 key, and the trust
// bundle of the SVID's own trust domain.
type Files struct {
	Cert   string
	Key    string
	Bundle string
}

// Source is a loaded SVID with its trust bundle. It serves go-spiffe's
// tlsconfig, which asks it on every handshake.
type Source struct {
	svid    *x509svid.SVID
	bundles *x509bundle.Set
}

var (
	_ x509svid.Source   = (*Source)(nil)
	_ x509bundle.Source = (*Source)(nil)
)

// Load reads the SVID and the bundle of its trust domain.
func Load(f Files) (*Source, error) {
	svid, err := x509svid.Load(f.Cert, f.Key)
	if err != nil {
		return nil, fmt.Errorf("loading SVID from %s and %s: %w", f.Cert, f.Key, err)
	}
	bundle, err := x509bundle.Load(svid.ID.TrustDomain(), f.Bundle)
	if err != nil {
		return nil, fmt.Errorf("loading trust bundle for %s from %s: %w", svid.ID.TrustDomain(), f.Bundle, err)
	}
	return &Source{svid: svid, bundles: x509bundle.NewSet(bundle)}, nil
}

// ID is this workload's SPIFFE ID.
func (s *Source) ID() spiffeid.ID { return s.svid.ID }

// GetX509SVID implements x509svid.Source.
func (s *Source) GetX509SVID() (*x509svid.SVID, error) { return s.svid, nil }

// GetX509BundleForTrustDomain implements x509bundle.Source.
func (s *Source) GetX509BundleForTrustDomain(td spiffeid.TrustDomain) (*x509bundle.Bundle, error) {
	return s.bundles.GetX509BundleForTrustDomain(td)
}
