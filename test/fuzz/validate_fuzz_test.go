// Package fuzz holds fuzz targets that need the test module's heavier
// dependencies, such as k8s.io/apimachinery, which the proto module must
// not import.
package fuzz

import (
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/util/validation"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// FuzzValidateAgainstApimachinery checks the tunnel's naming rules against
// Kubernetes' own: a namespace is accepted exactly when apimachinery's
// IsDNS1123Label accepts it, a Service name exactly when IsDNS1035Label
// does, and a logical cluster name (past one "system:") exactly when it is
// a DNS-1123 label of at least two characters. Each field is checked with
// the others valid, so that the verdict is about that field alone.
func FuzzValidateAgainstApimachinery(f *testing.F) {
	for _, s := range []string{
		"root", "default", "webhook", "a", "0", "a0", "0a", "-a", "a-", "a-b", "a--b",
		"system:admin", "system:", "system:system:root", "root:org", "Root", "a.b", "a_b",
		"röot", "root\n", "", strings.Repeat("x", 63), strings.Repeat("x", 64),
		"1x2y3z4w5v6u7t8s", "9webhook",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		valid := func(cluster, namespace, service string) bool {
			return (&tunnelv1.Target{Cluster: cluster, Namespace: namespace, Service: service, Port: 443}).Validate() == nil
		}
		if got, want := valid("root", s, "webhook"), len(validation.IsDNS1123Label(s)) == 0; got != want {
			t.Errorf("namespace %q: accepted=%v, apimachinery's IsDNS1123Label says %v", s, got, want)
		}
		if got, want := valid("root", "default", s), len(validation.IsDNS1035Label(s)) == 0; got != want {
			t.Errorf("service %q: accepted=%v, apimachinery's IsDNS1035Label says %v", s, got, want)
		}
		name := strings.TrimPrefix(s, "system:")
		want := len(name) >= 2 && len(validation.IsDNS1123Label(name)) == 0
		if got := valid(s, "default", "webhook"); got != want {
			t.Errorf("cluster %q: accepted=%v, want %v (a DNS-1123 label of 2 or more past one \"system:\")", s, got, want)
		}
		if got := tunnelv1.ValidateClusterName(s) == nil; got != want {
			t.Errorf("ValidateClusterName(%q) accepted=%v, want %v", s, got, want)
		}
	})
}
