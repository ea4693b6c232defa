package agent

import (
	"bytes"

	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
)

// svidWatch tells when the agent's SVID has rotated (see Fleet.SVID).
type svidWatch struct {
	source x509svid.Source
	leaf   []byte // the DER of the leaf certificate last seen
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
	return true
}

// leafOf is the DER of the source's leaf certificate; nil if it has none.
func leafOf(source x509svid.Source) []byte {
	svid, err := source.GetX509SVID()
	if err != nil || len(svid.Certificates) == 0 {
		return nil
	}
	return svid.Certificates[0].Raw
}
