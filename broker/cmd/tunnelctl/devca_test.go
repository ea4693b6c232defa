package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
)

// The files dev-ca writes load with the binaries' own loaders, and the
// policy lets each workload do what dev-ca says it may.
func TestDevCAWritesWhatTheBinariesLoad(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "dev")
	var out bytes.Buffer
	if err := devCA([]string{"--trust-domain", "dev.test", dir}, &out); err != nil {
		t.Fatal(err)
	}
	ids := map[string]spiffeid.ID{}
	for _, w := range devIdentities {
		src, err := identity.LoadFiles(identity.Files{
			Cert:   filepath.Join(dir, w.dir, "tls.crt"),
			Key:    filepath.Join(dir, w.dir, "tls.key"),
			Bundle: filepath.Join(dir, "ca.crt"),
		}, nil)
		if err != nil {
			t.Fatalf("%s: %v", w.dir, err)
		}
		ids[w.dir] = src.ID()
		if want := "spiffe://dev.test" + w.path; src.ID().String() != want {
			t.Errorf("%s's SVID is %s, want %s", w.dir, src.ID(), want)
		}
		if !strings.Contains(out.String(), src.ID().String()) {
			t.Errorf("dev-ca's output does not name %s:\n%s", src.ID(), out.String())
		}
	}
	pol, err := policy.Load(filepath.Join(dir, "policy.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := pol.MayServe(ids["agent"], []string{"root"}); err != nil {
		t.Error(err)
	}
	for _, caller := range []string{"kcp", "operator"} {
		if err := pol.MayDial(ids[caller], "root"); err != nil {
			t.Error(err)
		}
	}
	if c, err := pol.EgressCluster(ids["operator"]); c != "root" || err != nil {
		t.Errorf("the operator's CONNECTs go to %q, %v; want root, as the README's curl example needs", c, err)
	}
	if !pol.IsOperator(ids["operator"]) || pol.IsOperator(ids["kcp"]) || pol.IsAgent(ids["broker"]) {
		t.Error("the policy gives the dev identities other roles than dev-ca says")
	}
	services, err := lookup.LoadStatic(filepath.Join(dir, "services.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	addrs, err := services.Resolve(t.Context(), &tunnelv1.Target{Cluster: "root", Namespace: "default", Service: "web", Port: 80})
	if err != nil || len(addrs) != 1 || addrs[0] != "127.0.0.1:8080" {
		t.Errorf("services.yaml resolves root/default/web:80 to %v, %v; want 127.0.0.1:8080", addrs, err)
	}
}

// dev-ca never writes over a trust domain something may still use.
func TestDevCARefusesAFolderInUse(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "ca.crt"), []byte("in use"), 0o600); err != nil {
		t.Fatal(err)
	}
	err := devCA([]string{dir}, &bytes.Buffer{})
	if err == nil || !strings.Contains(err.Error(), "is not empty") {
		t.Fatalf("dev-ca into a folder in use: %v, want it refused", err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "ca.crt")); string(b) != "in use" {
		t.Error("dev-ca wrote over ca.crt")
	}
}

func TestDevCARefusesABadTrustDomain(t *testing.T) {
	err := devCA([]string{"--trust-domain", "Not/A/Domain", t.TempDir()}, &bytes.Buffer{})
	if err == nil || !strings.Contains(err.Error(), "--trust-domain") {
		t.Fatalf("got %v, want an error naming --trust-domain", err)
	}
}
