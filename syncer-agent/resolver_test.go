package main

import (
	"context"
	"flag"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The resolver flags are either a static file or the Kubernetes API, and
// every incomplete choice is refused with a message naming the flags.
func TestResolverFlagsRefuseBadCombinations(t *testing.T) {
	services := filepath.Join(t.TempDir(), "services.yaml")
	if err := os.WriteFile(services, []byte("services:\n- {cluster: root, namespace: default, name: webhook, ports: {\"443\": \"10.0.0.1:8443\"}}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	// An API server on loopback where nothing listens: the informers that
	// start try it and are refused, and nothing leaves the machine.
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(kubeconfig, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
`), 0o600); err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	for _, c := range []struct {
		args []string
		want string // "" for accepted
	}{
		{[]string{"--services", services}, ""},
		{nil, "give --services FILE"},
		{[]string{"--services", services, "--plain-cluster", "root"}, "--services excludes"},
		{[]string{"--kubeconfig", kubeconfig}, "give --services FILE"},
		{[]string{"--kubeconfig", kubeconfig, "--sync-target-name", "st"}, "its cluster or its UID"},
		{[]string{"--kubeconfig", kubeconfig, "--sync-target-name", "st", "--plain-cluster", "root"}, "either"},
		{[]string{"--kubeconfig", kubeconfig, "--plain-cluster", "root:org"}, "not a valid logical cluster name"},
		{[]string{"--kubeconfig", kubeconfig, "--plain-cluster", "root"}, ""},
		{[]string{"--kubeconfig", kubeconfig, "--sync-target-name", "st", "--sync-target-uid", "u"}, ""},
		{[]string{"--services", services, "--trust-endpointslices-in", "*"}, "--services excludes"},
		{[]string{"--kubeconfig", kubeconfig, "--plain-cluster", "root", "--trust-endpointslices-in", "root/Default"}, `--trust-endpointslices-in: "root/Default": namespace`},
		{[]string{"--kubeconfig", kubeconfig, "--plain-cluster", "root", "--trust-endpointslices-in", "root/default,c2"}, ""},
	} {
		name := strings.NewReplacer(services, "FILE", kubeconfig, "KUBECONFIG").Replace(strings.Join(c.args, " "))
		t.Run(name, func(t *testing.T) {
			fs := flag.NewFlagSet("syncer-agent", flag.ContinueOnError)
			f := addResolverFlags(fs)
			if err := fs.Parse(c.args); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			r, err := f.newResolver(ctx, log)
			cancel()
			if r != nil {
				r.stop()
			}
			switch {
			case c.want == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
				t.Fatalf("got %v, want an error saying %q", err, c.want)
			}
		})
	}
}
