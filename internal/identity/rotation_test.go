package identity

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/kcp-dev/tunnel-broker/internal/devca"
)

// csiDir lays out SVID files the way csi-driver-spiffe (and the kubelet's
// atomic writer) do: the files are symlinks into ..data, itself a symlink to
// a timestamped directory that each rotation replaces in one rename.
type csiDir struct {
	t   *testing.T
	dir string
	n   int
}

func newCSIDir(t *testing.T) *csiDir {
	d := &csiDir{t: t, dir: t.TempDir()}
	for _, name := range []string{"tls.crt", "tls.key", "ca.crt"} {
		if err := os.Symlink(filepath.Join("..data", name), filepath.Join(d.dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	return d
}

func (d *csiDir) files() Files {
	return Files{Cert: filepath.Join(d.dir, "tls.crt"), Key: filepath.Join(d.dir, "tls.key"), Bundle: filepath.Join(d.dir, "ca.crt")}
}

// rotate writes new contents and swaps ..data to them atomically.
func (d *csiDir) rotate(cert, key, bundle []byte) {
	d.n++
	ts := filepath.Join(d.dir, "..ts"+string(rune('a'+d.n)))
	if err := os.Mkdir(ts, 0o700); err != nil {
		d.t.Fatal(err)
	}
	for name, b := range map[string][]byte{"tls.crt": cert, "tls.key": key, "ca.crt": bundle} {
		if err := os.WriteFile(filepath.Join(ts, name), b, 0o600); err != nil {
			d.t.Fatal(err)
		}
	}
	tmp := filepath.Join(d.dir, "..data_tmp")
	if err := os.Symlink(filepath.Base(ts), tmp); err != nil {
		d.t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(d.dir, "..data")); err != nil {
		d.t.Fatal(err)
	}
}

func issue(t *testing.T, ca *devca.CA, path string) *devca.Issued {
	t.Helper()
	l, err := ca.Issue(devca.Leaf{SPIFFEID: path})
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func serialOf(t *testing.T, s *FileSource) string {
	t.Helper()
	svid, err := s.GetX509SVID()
	if err != nil {
		t.Fatal(err)
	}
	return svid.Certificates[0].SerialNumber.String()
}

// loadRotating lays out a first SVID from a new CA in a csiDir and loads it.
func loadRotating(t *testing.T) (*devca.CA, *csiDir, *devca.Issued, *FileSource) {
	t.Helper()
	ca, err := devca.New("ca", "example.org")
	if err != nil {
		t.Fatal(err)
	}
	d := newCSIDir(t)
	first := issue(t, ca, "/agent")
	d.rotate(first.CertPEM, first.KeyPEM, ca.BundlePEM())
	s, err := LoadFiles(d.files(), nil)
	if err != nil {
		t.Fatal(err)
	}
	return ca, d, first, s
}

func TestFileSourceFollowsAtomicRotation(t *testing.T) {
	ca, d, _, s := loadRotating(t)
	before := serialOf(t, s)

	if s.Reload() {
		t.Fatal("Reload reported new material while nothing changed")
	}
	// A new SVID and a new CA (bundle rotation) arrive together.
	ca2, err := devca.New("ca2", "example.org")
	if err != nil {
		t.Fatal(err)
	}
	second := issue(t, ca2, "/agent")
	d.rotate(second.CertPEM, second.KeyPEM, ca2.BundlePEM())
	if !s.Reload() {
		t.Fatal("Reload did not pick up the rotation")
	}
	if serialOf(t, s) == before {
		t.Fatal("the SVID did not change")
	}
	b, err := s.GetX509BundleForTrustDomain(spiffeid.RequireTrustDomainFromString("example.org"))
	if err != nil || !b.HasX509Authority(ca2.Cert) || b.HasX509Authority(ca.Cert) {
		t.Fatalf("the bundle did not rotate with the SVID: %v", err)
	}
}

func TestFileSourceKeepsOldMaterialWhenRotationIsHalfWritten(t *testing.T) {
	ca, d, first, s := loadRotating(t)
	before := serialOf(t, s)

	second := issue(t, ca, "/agent")
	for name, broken := range map[string][3][]byte{
		"truncated certificate": {second.CertPEM[:len(second.CertPEM)/2], second.KeyPEM, ca.BundlePEM()},
		"key of another SVID":   {second.CertPEM, first.KeyPEM, ca.BundlePEM()},
		"empty bundle":          {second.CertPEM, second.KeyPEM, nil},
	} {
		d.rotate(broken[0], broken[1], broken[2])
		if s.Reload() {
			t.Fatalf("%s: Reload took broken material", name)
		}
		if serialOf(t, s) != before {
			t.Fatalf("%s: the old SVID was dropped", name)
		}
	}
	// The writer finishes: the new material is taken.
	d.rotate(second.CertPEM, second.KeyPEM, ca.BundlePEM())
	if !s.Reload() || serialOf(t, s) == before {
		t.Fatal("the completed rotation was not taken")
	}
}

func TestFileSourceWatchesWithoutRestart(t *testing.T) {
	ca, d, _, s := loadRotating(t)
	s.Watch(10 * time.Millisecond)
	defer s.Close()
	before := serialOf(t, s)
	second := issue(t, ca, "/agent")
	d.rotate(second.CertPEM, second.KeyPEM, ca.BundlePEM())
	deadline := time.Now().Add(10 * time.Second)
	for serialOf(t, s) == before {
		if time.Now().After(deadline) {
			t.Fatal("the watcher did not pick up the rotation")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestFileSourceTrustsFederatedBundles(t *testing.T) {
	ours, err := devca.New("ours", "example.org")
	if err != nil {
		t.Fatal(err)
	}
	theirs, err := devca.New("theirs", "partner.org")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	f, err := ours.WriteSVID(dir, devca.Leaf{SPIFFEID: "/broker"})
	if err != nil {
		t.Fatal(err)
	}
	partner := filepath.Join(dir, "partner.crt")
	if err := os.WriteFile(partner, theirs.BundlePEM(), 0o600); err != nil {
		t.Fatal(err)
	}
	s, err := LoadFiles(Files{Cert: f.Cert, Key: f.Key, Bundle: f.Bundle, Federated: map[string]string{"partner.org": partner}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, err := s.GetX509BundleForTrustDomain(spiffeid.RequireTrustDomainFromString("partner.org"))
	if err != nil || !b.HasX509Authority(theirs.Cert) {
		t.Fatalf("no bundle for partner.org: %v", err)
	}
	if _, err := s.GetX509BundleForTrustDomain(spiffeid.RequireTrustDomainFromString("other.org")); err == nil {
		t.Fatal("a bundle for a trust domain nobody configured")
	}
}
