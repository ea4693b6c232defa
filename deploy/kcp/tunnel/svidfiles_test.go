package tunnel

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net/url"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
)

// testCA issues X.509-SVIDs of trust domain example.org.
type testCA struct {
	cert *x509.Certificate
	key  crypto.Signer
}

func newTestCA(t *testing.T) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		URIs:      []*url.URL{{Scheme: "spiffe", Host: "example.org"}},
		NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	return &testCA{cert: cert, key: key}
}

// writeSVID writes an SVID for spiffe://example.org/kcp with serial, its
// key and the CA's bundle into dir, and returns the three paths.
func (ca *testCA) writeSVID(t *testing.T, dir string, serial int64) (cert, key, bundle string) {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial),
		URIs:         []*url.URL{{Scheme: "spiffe", Host: "example.org", Path: "/kcp"}},
		NotBefore:    time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, k.Public(), ca.key)
	if err != nil {
		t.Fatal(err)
	}
	pkcs8, err := x509.MarshalPKCS8PrivateKey(k)
	if err != nil {
		t.Fatal(err)
	}
	cert, key, bundle = filepath.Join(dir, "svid.pem"), filepath.Join(dir, "svid_key.pem"), filepath.Join(dir, "bundle.pem")
	writePEM(t, cert, "CERTIFICATE", der)
	writePEM(t, key, "PRIVATE KEY", pkcs8)
	writePEM(t, bundle, "CERTIFICATE", ca.cert.Raw)
	return cert, key, bundle
}

func writePEM(t *testing.T, path, kind string, der []byte) {
	t.Helper()
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}

func serialOf(t *testing.T, s *fileSource) int64 {
	t.Helper()
	svid, err := s.GetX509SVID()
	if err != nil {
		t.Fatal(err)
	}
	return svid.Certificates[0].SerialNumber.Int64()
}

func TestFileSourceFollowsRotation(t *testing.T) {
	ca, dir := newTestCA(t), t.TempDir()
	cert, key, bundle := ca.writeSVID(t, dir, 1)
	s, err := loadFiles(cert, key, bundle, logr.Discard())
	if err != nil {
		t.Fatal(err)
	}
	if got := serialOf(t, s); got != 1 {
		t.Fatalf("serial %d, want 1", got)
	}
	if s.reload() {
		t.Fatal("reload() swapped material although no file changed")
	}

	ca.writeSVID(t, dir, 2)
	if !s.reload() || serialOf(t, s) != 2 {
		t.Fatalf("after a rotation: serial %d, want 2", serialOf(t, s))
	}
}

func TestFileSourceKeepsTheLastGoodSVIDDuringAHalfWrittenRotation(t *testing.T) {
	ca, dir := newTestCA(t), t.TempDir()
	cert, key, bundle := ca.writeSVID(t, dir, 1)
	s, err := loadFiles(cert, key, bundle, logr.Discard())
	if err != nil {
		t.Fatal(err)
	}
	oldKey, err := os.ReadFile(key)
	if err != nil {
		t.Fatal(err)
	}
	// The new certificate is written, its key not yet.
	ca.writeSVID(t, dir, 2)
	if err := os.WriteFile(key, oldKey, 0o600); err != nil {
		t.Fatal(err)
	}
	if s.reload() || serialOf(t, s) != 1 {
		t.Fatalf("a certificate without its key was swapped in: serial %d", serialOf(t, s))
	}
	// The writer finishes: the next read takes both.
	ca.writeSVID(t, dir, 3)
	if !s.reload() || serialOf(t, s) != 3 {
		t.Fatalf("after the rotation completed: serial %d, want 3", serialOf(t, s))
	}
}

func TestFileSourceTrustsItsOwnTrustDomainOnly(t *testing.T) {
	ca, dir := newTestCA(t), t.TempDir()
	cert, key, bundle := ca.writeSVID(t, dir, 1)
	s, err := loadFiles(cert, key, bundle, logr.Discard())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.GetX509BundleForTrustDomain(spiffeid.RequireTrustDomainFromString("example.org")); err != nil {
		t.Fatalf("own trust domain: %v", err)
	}
	if _, err := s.GetX509BundleForTrustDomain(spiffeid.RequireTrustDomainFromString("other.org")); err == nil {
		t.Fatal("a bundle for another trust domain, which kcp was given none of")
	}
}

func TestLoadFilesRefusesFilesThatAreNoSVID(t *testing.T) {
	ca, dir := newTestCA(t), t.TempDir()
	cert, key, bundle := ca.writeSVID(t, dir, 1)
	if _, err := loadFiles(bundle, key, bundle, logr.Discard()); err == nil {
		t.Fatal("loadFiles took a CA certificate with another certificate's key as kcp's SVID")
	}
	if _, err := loadFiles(cert, key, filepath.Join(dir, "missing.pem"), logr.Discard()); err == nil {
		t.Fatal("loadFiles took a missing bundle file")
	}
}
