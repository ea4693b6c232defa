// Package devca mints throwaway certificate authorities for tests and the
// demo: a SPIFFE trust domain whose X.509-SVIDs the broker, agents and
// callers use, and plain TLS CAs for webhook servers (a webhook's caBundle).
package devca

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"time"
)

// CA is a self-signed certificate authority.
type CA struct {
	Cert *x509.Certificate
	Key  crypto.Signer
	// TrustDomain is set for SPIFFE CAs; their leaves carry spiffe:// URIs.
	TrustDomain string
}

// New makes a CA named name. For a SPIFFE trust domain pass its name as
// trustDomain; for a plain TLS CA pass "".
func New(name, trustDomain string) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: name, Organization: []string{"kcp tunnel broker dev"}},
		NotBefore:             time.Now().Add(-time.Minute),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
	}
	if trustDomain != "" {
		tmpl.URIs = []*url.URL{{Scheme: "spiffe", Host: trustDomain}}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &CA{Cert: cert, Key: key, TrustDomain: trustDomain}, nil
}

// Leaf describes a certificate to issue.
type Leaf struct {
	// SPIFFEID, for SVIDs: a path in the CA's trust domain, e.g. "/broker".
	SPIFFEID string
	// URIs are URI SANs taken as they are, for tests of malformed
	// identities (a SPIFFE ID without a path, an ID too long, several
	// URIs); they come after SPIFFEID's, if any.
	URIs       []*url.URL
	CommonName string
	DNSNames   []string
	IPs        []net.IP
	NotBefore  time.Time // default: a minute ago
	NotAfter   time.Time // default: in 24 hours
}

// Issued is a certificate and its key, in PEM.
type Issued struct {
	CertPEM []byte
	KeyPEM  []byte
}

// Issue signs a leaf for both client and server use.
func (ca *CA) Issue(l Leaf) (*Issued, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	if l.NotBefore.IsZero() {
		l.NotBefore = time.Now().Add(-time.Minute)
	}
	if l.NotAfter.IsZero() {
		l.NotAfter = time.Now().Add(24 * time.Hour)
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: l.CommonName},
		NotBefore:    l.NotBefore,
		NotAfter:     l.NotAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment | x509.KeyUsageKeyAgreement,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		DNSNames:     l.DNSNames,
		IPAddresses:  l.IPs,
	}
	if l.SPIFFEID != "" {
		if ca.TrustDomain == "" {
			return nil, fmt.Errorf("CA %s is not a SPIFFE CA", ca.Cert.Subject.CommonName)
		}
		tmpl.URIs = []*url.URL{{Scheme: "spiffe", Host: ca.TrustDomain, Path: l.SPIFFEID}}
	}
	tmpl.URIs = append(tmpl.URIs, l.URIs...)
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, key.Public(), ca.Key)
	if err != nil {
		return nil, err
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, err
	}
	return &Issued{
		CertPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		KeyPEM:  pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}),
	}, nil
}

// BundlePEM is the CA certificate in PEM: a trust bundle or a caBundle.
func (ca *CA) BundlePEM() []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ca.Cert.Raw})
}

// Files are where WriteSVID put an SVID, named as csi-driver-spiffe names them.
type Files struct {
	Dir, Cert, Key, Bundle string
}

// WriteSVID issues l and writes tls.crt, tls.key and ca.crt into dir.
func (ca *CA) WriteSVID(dir string, l Leaf) (Files, error) {
	issued, err := ca.Issue(l)
	if err != nil {
		return Files{}, err
	}
	f := Files{Dir: dir, Cert: filepath.Join(dir, "tls.crt"), Key: filepath.Join(dir, "tls.key"), Bundle: filepath.Join(dir, "ca.crt")}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return Files{}, err
	}
	for path, data := range map[string][]byte{f.Cert: issued.CertPEM, f.Key: issued.KeyPEM, f.Bundle: ca.BundlePEM()} {
		if err := os.WriteFile(path, data, 0o600); err != nil {
			return Files{}, err
		}
	}
	return f, nil
}

func serial() *big.Int {
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	return n
}
