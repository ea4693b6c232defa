package identity

import (
	"bytes"
	"context"
	"time"

	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
)

// Rotations delivers each time the source's SVID changes, looking every
// interval, until ctx ends. A connection keeps the SVID it was opened with,
// which the server stops accepting once it expires: a client that moves
// to new connections when its SVID rotates never reaches that point.
func Rotations(ctx context.Context, src x509svid.Source, every time.Duration) <-chan struct{} {
	if every <= 0 {
		every = 5 * time.Second
	}
	out := make(chan struct{}, 1)
	current := leafOf(src)
	go func() {
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			leaf := leafOf(src)
			if leaf == nil || bytes.Equal(leaf, current) {
				continue
			}
			current = leaf
			select {
			case out <- struct{}{}:
			default: // one pending delivery says it all
			}
		}
	}()
	return out
}

// leafOf is the DER of the source's leaf certificate; nil if it has none.
func leafOf(src x509svid.Source) []byte {
	svid, err := src.GetX509SVID()
	if err != nil || len(svid.Certificates) == 0 {
		return nil
	}
	return svid.Certificates[0].Raw
}
