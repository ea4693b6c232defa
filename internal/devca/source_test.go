package devca_test

import (
	"strings"
	"testing"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"

	"github.com/kcp-dev/tunnel-broker/internal/devca"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
)

// A Source is what the broker's and the agent's credentials take.
var _ identity.SVIDSource = (*devca.Source)(nil)

func TestSourceServesAnSVIDItsBundleVerifies(t *testing.T) {
	ca, err := devca.New("test", "example.org")
	if err != nil {
		t.Fatal(err)
	}
	src, err := ca.Source(devca.Leaf{SPIFFEID: "/agent"})
	if err != nil {
		t.Fatal(err)
	}
	want := spiffeid.RequireFromString("spiffe://example.org/agent")
	if src.ID() != want {
		t.Errorf("ID %s, want %s", src.ID(), want)
	}
	svid, err := src.GetX509SVID()
	if err != nil {
		t.Fatal(err)
	}
	if svid.ID != want {
		t.Errorf("SVID for %s, want %s", svid.ID, want)
	}
	// The source trusts its own SVID, and so peers the same CA issued.
	id, _, err := x509svid.Verify(svid.Certificates, src)
	if err != nil || id != want {
		t.Errorf("verifying the SVID with the source's bundle: %s, %v; want %s", id, err, want)
	}

	bundle, err := src.GetX509BundleForTrustDomain(want.TrustDomain())
	if err != nil {
		t.Fatal(err)
	}
	if !bundle.HasX509Authority(ca.Cert) || len(bundle.X509Authorities()) != 1 {
		t.Errorf("bundle holds %d authorities, want exactly the CA", len(bundle.X509Authorities()))
	}
	if _, err := src.GetX509BundleForTrustDomain(spiffeid.RequireTrustDomainFromString("other.org")); err == nil {
		t.Error("the source has a bundle for other.org, want none")
	}
}

func TestSourceRefusesWhatIsNoSVID(t *testing.T) {
	spiffeCA, err := devca.New("test", "example.org")
	if err != nil {
		t.Fatal(err)
	}
	tlsCA, err := devca.New("webhook", "")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		ca   *devca.CA
		leaf devca.Leaf
		want string
	}{
		{"no SPIFFE ID", spiffeCA, devca.Leaf{CommonName: "webhook"}, "needs a SPIFFE ID"},
		{"plain TLS CA", tlsCA, devca.Leaf{SPIFFEID: "/agent"}, "CA webhook has no valid SPIFFE trust domain"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src, err := tc.ca.Source(tc.leaf)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("got %v, %v; want an error containing %q", src, err, tc.want)
			}
		})
	}
}
