package agent

import (
	"bytes"
	"time"

	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
)

// svidWatch tells when the agent's SVID has rotated (see Fleet.SVID).
type svidWatch struct {
	source x509svid.Source
	leaf   []byte // the DER of the leaf certificate last seen
	// warned is when expiring last warned of the leaf last seen.
	warned time.Time
}

func watchSVID(source x509svid.Source) *svidWatch {
	return &svidWatch{source: source, leaf: leafOf(source)}
}

// rotated reports whether the source's leaf certificate is another than the
// one last seen. A source that has none now keeps the one last seen.
func (w *svidWatch) rotated() bool {
	leaf := leafOf(w.source)
	if leaf == nil || bytes.Equal(leaf, w.leaf) {
		return false
	}
	w.leaf = leaf
	w.warned = time.Time{}
	return true
}

// expiringWarnEvery is how often, at most, the agent warns that its SVID
// is about to expire and no new one has come.
const expiringWarnEvery = time.Minute

// expiring reports how long the SVID has left, and whether to warn that no
// new one has come: once it is in the last quarter of its lifetime (SPIRE
// renews at half of it, cert-manager's csi-driver-spiffe at two thirds),
// at most every expiringWarnEvery.
func (w *svidWatch) expiring(now time.Time) (left time.Duration, notAfter time.Time, warn bool) {
	svid, err := w.source.GetX509SVID()
	if err != nil || svid == nil || len(svid.Certificates) == 0 {
		return 0, time.Time{}, false
	}
	leaf := svid.Certificates[0]
	left = leaf.NotAfter.Sub(now)
	if left <= 0 || left > leaf.NotAfter.Sub(leaf.NotBefore)/4 {
		return left, leaf.NotAfter, false
	}
	if !w.warned.IsZero() && now.Sub(w.warned) < expiringWarnEvery {
		return left, leaf.NotAfter, false
	}
	w.warned = now
	return left, leaf.NotAfter, true
}

// leafOf is the DER of the source's leaf certificate; nil if it has none.
func leafOf(source x509svid.Source) []byte {
	svid, err := source.GetX509SVID()
	if err != nil || len(svid.Certificates) == 0 {
		return nil
	}
	return svid.Certificates[0].Raw
}
