package identity

import (
	"context"
	"testing"

	"github.com/kcp-dev/tunnel-broker/internal/devca"
)

func TestOpenWithIDReturnsTheIDTheSVIDNames(t *testing.T) {
	ca, err := devca.New("ca", "example.org")
	if err != nil {
		t.Fatal(err)
	}
	f, err := ca.WriteSVID(t.TempDir(), devca.Leaf{SPIFFEID: "/broker"})
	if err != nil {
		t.Fatal(err)
	}
	src, self, err := OpenWithID(context.Background(), Options{Files: Files{Cert: f.Cert, Key: f.Key, Bundle: f.Bundle}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	if got, want := self.String(), "spiffe://example.org/broker"; got != want {
		t.Errorf("OpenWithID: ID %s, want %s", got, want)
	}

	if _, _, err := OpenWithID(context.Background(), Options{Files: Files{Cert: f.Cert, Key: f.Key, Bundle: t.TempDir() + "/none.pem"}}, nil); err == nil {
		t.Error("OpenWithID opened an identity whose bundle does not exist")
	}
}
