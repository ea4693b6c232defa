package identity

import (
	"bytes"
	"crypto/x509"
	"fmt"
	"os"
	"strings"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
)

// The identity flags, as errors name them.
const (
	flagSocket    = "--spiffe-socket"
	flagCert      = "--svid-cert"
	flagKey       = "--svid-key"
	flagBundle    = "--trust-bundle"
	flagFederated = "--federated-bundle"
	flagTimeout   = "--workload-api-timeout"
)

// checkFiles reads the SVID files the flags name, one by one, so that what
// is wrong is said with the flag that named the file: a missing file, a key
// that is not PKCS#8, a leaf that is no X.509-SVID, a bundle without a CA.
// FileSource.load says it again on every reload, without flags.
func checkFiles(f Files) error {
	cert, err := readFlagFile(flagCert, f.Cert)
	if err != nil {
		return err
	}
	key, err := readFlagFile(flagKey, f.Key)
	if err != nil {
		return err
	}
	svid, err := x509svid.Parse(cert, key)
	if err != nil {
		return fmt.Errorf("%s %s with %s %s: %w%s", flagCert, f.Cert, flagKey, f.Key, err, svidHint(key))
	}
	if err := checkBundleFile(flagBundle+" "+f.Bundle, svid.ID.TrustDomain(), f.Bundle); err != nil {
		return err
	}
	for _, name := range sortedKeys(f.Federated) {
		td, err := spiffeid.TrustDomainFromString(name)
		if err != nil {
			return fmt.Errorf("%s %s=%s: %w", flagFederated, name, f.Federated[name], err)
		}
		if err := checkBundleFile(flagFederated+" "+name+"="+f.Federated[name], td, f.Federated[name]); err != nil {
			return err
		}
	}
	return nil
}

func readFlagFile(flag, path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", flag, err)
	}
	return b, nil
}

// svidHint says how to fix the two mistakes people make most with SVIDs
// they made themselves.
func svidHint(key []byte) string {
	if bytes.Contains(key, []byte("-----BEGIN EC PRIVATE KEY-----")) || bytes.Contains(key, []byte("-----BEGIN RSA PRIVATE KEY-----")) {
		return " (the key must be PKCS#8, -----BEGIN PRIVATE KEY-----: convert it with openssl pkcs8 -topk8 -nocrypt)"
	}
	return " (an X.509-SVID's leaf holds one spiffe:// URI SAN, the digitalSignature key usage and no CA flag; SPIRE, csi-driver-spiffe and tunnelctl dev-ca write such files)"
}

func checkBundleFile(named string, td spiffeid.TrustDomain, path string) error {
	raw, err := readFlagFile(named, path)
	if err != nil {
		return err
	}
	b, err := x509bundle.Parse(td, raw)
	if err != nil {
		return fmt.Errorf("%s: %w", named, err)
	}
	if err := holdsCA(b.X509Authorities()); err != nil {
		return fmt.Errorf("%s: %w", named, err)
	}
	return nil
}

// holdsCA refuses a trust bundle without a CA certificate: most likely an
// SVID given where its trust domain's bundle belongs. Such a bundle would
// verify no peer, and every handshake would fail as untrusted.
func holdsCA(certs []*x509.Certificate) error {
	if len(certs) == 0 {
		return fmt.Errorf("holds no certificate")
	}
	for _, c := range certs {
		if c.IsCA {
			return nil
		}
	}
	var names []string
	for _, c := range certs {
		name := c.Subject.String()
		for _, u := range c.URIs {
			name = u.String()
		}
		names = append(names, name)
	}
	return fmt.Errorf("holds no CA certificate, only %s: is it an SVID? A trust bundle holds the trust domain's CA certificates (csi-driver-spiffe's ca.crt)",
		strings.Join(names, ", "))
}
