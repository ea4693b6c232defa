package identity

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"time"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
)

// Bounds of a SPIFFE ID, from the SPIFFE ID specification; gRPC holds IDs
// past them invalid too.
const (
	MaxIDLength          = 2048
	MaxTrustDomainLength = 255
)

var errNoCertificate = errors.New("the peer presented no certificate")

// verifyPeer checks the peer's X.509-SVID against the trust bundles and the
// authorizer, on every handshake. go-spiffe's tlsconfig does the same in
// VerifyPeerCertificate, which crypto/tls skips when a session is resumed:
// a client holding a session ticket was admitted after its CA had left the
// bundle. VerifyConnection runs on full and resumed handshakes alike, so
// it is where this check goes.
func verifyPeer(bundles x509bundle.Source, authorize tlsconfig.Authorizer) func(tls.ConnectionState) error {
	return func(cs tls.ConnectionState) error {
		if len(cs.PeerCertificates) == 0 {
			return refused(ReasonNoCertificate, errNoCertificate)
		}
		id, chains, err := x509svid.Verify(cs.PeerCertificates, bundles)
		if err != nil {
			return refused(verifyFailure(cs.PeerCertificates[0], err), presented(cs.PeerCertificates[0], err))
		}
		if err := ValidateWorkloadID(id); err != nil {
			return refused(ReasonInvalidID, err)
		}
		if err := authorize(id, chains); err != nil {
			return refused(ReasonUnauthorized, err)
		}
		return nil
	}
}

// presented says which identity the peer presented that failed to verify,
// so that the side that refused it can be told apart from the side at fault.
func presented(leaf *x509.Certificate, err error) error {
	id, idErr := x509svid.IDFromCert(leaf)
	if idErr != nil {
		return fmt.Errorf("the peer presented a certificate with no valid SPIFFE ID (subject %q): %w", leaf.Subject.String(), err)
	}
	return fmt.Errorf("the peer presented %s, which does not verify against the trust bundle held for trust domain %s: %w", id, id.TrustDomain(), err)
}

// verifyFailure names why go-spiffe refused a chain.
func verifyFailure(leaf *x509.Certificate, err error) Reason {
	if _, idErr := x509svid.IDFromCert(leaf); idErr != nil {
		return ReasonInvalidID
	}
	var invalid x509.CertificateInvalidError
	if errors.As(err, &invalid) && invalid.Reason == x509.Expired && time.Now().After(invalid.Cert.NotAfter) {
		return ReasonExpired
	}
	return ReasonUntrusted
}

// ValidateWorkloadID refuses SPIFFE IDs that go-spiffe parses but that no
// workload may hold: an X.509-SVID's ID must have a path (an ID without one
// names a trust domain), and SPIFFE bounds an ID to 2048 bytes and a trust
// domain name to 255. gRPC leaves TLSInfo.SPIFFEID nil for such IDs, so
// refusing them also keeps every admitted peer's TLSInfo complete.
func ValidateWorkloadID(id spiffeid.ID) error {
	s := id.String()
	switch {
	case id.IsZero():
		return errors.New("no SPIFFE ID")
	case len(s) > MaxIDLength:
		return fmt.Errorf("SPIFFE ID %s is %d bytes long, more than the %d bytes SPIFFE allows", shorten(s), len(s), MaxIDLength)
	case len(id.TrustDomain().Name()) > MaxTrustDomainLength:
		return fmt.Errorf("SPIFFE ID %s has a trust domain name of %d bytes, more than the %d SPIFFE allows", shorten(s), len(id.TrustDomain().Name()), MaxTrustDomainLength)
	case id.Path() == "":
		return fmt.Errorf("SPIFFE ID %s has no path: it names a trust domain, not a workload", s)
	}
	return nil
}

// shorten keeps log lines and errors about huge IDs readable.
func shorten(s string) string {
	const keep = 96
	if len(s) <= keep {
		return s
	}
	return s[:keep] + "..."
}
