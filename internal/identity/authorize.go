package identity

import (
	"crypto/x509"
	"fmt"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
)

// AuthorizeID accepts exactly want, like go-spiffe's tlsconfig.AuthorizeID,
// but its refusal says what the peer presented and what was expected, and
// where that expectation comes from (e.g. "--broker-spiffe-id"): it is
// logged on the side that refuses, which may be the side at fault.
func AuthorizeID(want spiffeid.ID, from string) tlsconfig.Authorizer {
	return func(got spiffeid.ID, _ [][]*x509.Certificate) error {
		if got != want {
			return fmt.Errorf("the peer presented %s, but %s expects %s", got, from, want)
		}
		return nil
	}
}

// AuthorizeMemberOf accepts any ID of td, like go-spiffe's
// tlsconfig.AuthorizeMemberOf, and its refusal says so.
func AuthorizeMemberOf(td spiffeid.TrustDomain, from string) tlsconfig.Authorizer {
	return func(got spiffeid.ID, _ [][]*x509.Certificate) error {
		if !got.MemberOf(td) {
			return fmt.Errorf("the peer presented %s, but %s expects an ID of trust domain %s", got, from, td)
		}
		return nil
	}
}
