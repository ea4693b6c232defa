package devca

import (
	"crypto/x509"
	"errors"
	"fmt"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
)

// Source is an X.509-SVID and its trust domain's bundle, held in memory: the
// identity of a workload run in process, without SVID files or a Workload
// API. It is a go-spiffe x509svid.Source and x509bundle.Source, which is what
// identity.ServerCredentials and identity.ClientCredentials take. It never
// rotates.
type Source struct {
	svid   *x509svid.SVID
	bundle *x509bundle.Bundle
}

var (
	_ x509svid.Source   = (*Source)(nil)
	_ x509bundle.Source = (*Source)(nil)
)

// Source issues l, which must name a SPIFFE ID, and returns it as a source
// that trusts the CA's trust domain.
func (ca *CA) Source(l Leaf) (*Source, error) {
	if l.SPIFFEID == "" {
		return nil, errors.New("an SVID source needs a SPIFFE ID")
	}
	td, err := spiffeid.TrustDomainFromString(ca.TrustDomain)
	if err != nil {
		return nil, fmt.Errorf("CA %s has no valid SPIFFE trust domain: %w", ca.Cert.Subject.CommonName, err)
	}
	issued, err := ca.Issue(l)
	if err != nil {
		return nil, err
	}
	svid, err := x509svid.Parse(issued.CertPEM, issued.KeyPEM)
	if err != nil {
		return nil, err
	}
	return &Source{svid: svid, bundle: x509bundle.FromX509Authorities(td, []*x509.Certificate{ca.Cert})}, nil
}

// ID is the SPIFFE ID the source presents.
func (s *Source) ID() spiffeid.ID { return s.svid.ID }

// GetX509SVID returns the SVID.
func (s *Source) GetX509SVID() (*x509svid.SVID, error) { return s.svid, nil }

// GetX509BundleForTrustDomain returns the CA's bundle for its own trust
// domain and an error for any other.
func (s *Source) GetX509BundleForTrustDomain(td spiffeid.TrustDomain) (*x509bundle.Bundle, error) {
	return s.bundle.GetX509BundleForTrustDomain(td)
}
