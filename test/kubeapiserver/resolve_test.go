package kubeapiserver

import (
	"context"
	"testing"

	"google.golang.org/grpc/codes"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
)

// A dial of (logical cluster, upstream namespace, Service, port) reaches the
// endpoint the physical cluster's API names, for namespaces of either
// locator annotation, and follows the API as it changes.
func TestKubeAPIServerResolvesSyncedServices(t *testing.T) {
	w := newWorld(t)
	current := w.syncedNamespace(w.syncTarget, lookup.NamespaceLocatorAnnotation, "c1", "default")
	legacy := w.syncedNamespace(w.syncTarget, lookup.LegacyNamespaceLocatorAnnotation, "c2", "team")
	first, second := startServer(t, webhookPort), startServer(t, webhookPort)
	w.service(current, "webhook", intstr.FromInt32(webhookPort))
	w.mustSetEndpoints(current, "webhook", "webhook-abcde", webhookPort, ready(first.ip)...)
	w.service(legacy, "webhook", intstr.FromInt32(webhookPort))
	w.mustSetEndpoints(legacy, "webhook", "webhook-fghij", webhookPort, ready(second.ip)...)

	k := w.startAgent(lookup.KubeOptions{})
	if got := k.Clusters(); len(got) != 2 || got[0] != "c1" || got[1] != "c2" {
		t.Fatalf("Clusters() = %v, want [c1 c2]", got)
	}
	w.mustReach("c1", "default", "webhook", 443, first)
	w.mustReach("c2", "team", "webhook", 443, second)

	t.Run("endpoint change", func(t *testing.T) {
		w.mustSetEndpoints(current, "webhook", "webhook-abcde", webhookPort, ready(second.ip)...)
		w.eventuallyReach("c1", "default", "webhook", 443, second)
	})
	t.Run("not ready", func(t *testing.T) {
		w.mustSetEndpoints(current, "webhook", "webhook-abcde", webhookPort, endpoint{IP: second.ip, Ready: false})
		w.eventuallyRefused("c1", "default", "webhook", 443, codes.Unavailable)
	})
	t.Run("no such port", func(t *testing.T) {
		w.wantRefusal("c1", "default", "webhook", 444, codes.NotFound)
	})
	t.Run("service deleted", func(t *testing.T) {
		if err := w.admin.CoreV1().Services(legacy).Delete(context.Background(), "webhook", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		w.eventuallyRefused("c2", "team", "webhook", 443, codes.NotFound)
	})
	t.Run("new cluster", func(t *testing.T) {
		// A workspace newly bound to the sync target: the agent
		// re-registers and the broker routes the new cluster to it.
		ns := w.syncedNamespace(w.syncTarget, lookup.NamespaceLocatorAnnotation, "c3", "default")
		w.service(ns, "webhook", intstr.FromInt32(webhookPort))
		w.mustSetEndpoints(ns, "webhook", "webhook-klmno", webhookPort, ready(first.ip)...)
		w.eventuallyReach("c3", "default", "webhook", 443, first)
	})
}

// A named targetPort: the EndpointSlice controller resolves it per pod and
// files the number under the Service port's name.
func TestKubeAPIServerNamedTargetPort(t *testing.T) {
	w := newWorld(t)
	ns := w.syncedNamespace(w.syncTarget, lookup.NamespaceLocatorAnnotation, "c1", "default")
	s := startServer(t, 9443)
	w.service(ns, "webhook", intstr.FromString("webhook-tls"))
	w.mustSetEndpoints(ns, "webhook", "webhook-abcde", 9443, ready(s.ip)...)
	w.startAgent(lookup.KubeOptions{})
	w.mustReach("c1", "default", "webhook", 443, s)
}

// Several ready endpoints: dials spread over all of them, and an endpoint
// that refuses connections is skipped for the next.
func TestKubeAPIServerSpreadsAndFallsBack(t *testing.T) {
	w := newWorld(t)
	ns := w.syncedNamespace(w.syncTarget, lookup.NamespaceLocatorAnnotation, "c1", "default")
	servers := []*server{startServer(t, webhookPort), startServer(t, webhookPort), startServer(t, webhookPort)}
	w.service(ns, "webhook", intstr.FromInt32(webhookPort))
	w.mustSetEndpoints(ns, "webhook", "webhook-abcde", webhookPort, ready(servers[0].ip, servers[1].ip)...)
	w.mustSetEndpoints(ns, "webhook", "webhook-fghij", webhookPort, ready(servers[2].ip)...)
	w.startAgent(lookup.KubeOptions{})

	// The agent starts each dial at the next endpoint: three dials in a
	// row reach all three.
	seen := map[string]bool{}
	for range 3 {
		got, err := w.dial("c1", "default", "webhook", 443)
		if err != nil {
			t.Fatal(err)
		}
		seen[got] = true
	}
	if len(seen) != 3 {
		t.Fatalf("three dials reached %v, want all three endpoints", seen)
	}

	// Two endpoints refuse: every dial still gets through, to the third.
	servers[0].stop()
	servers[2].stop()
	for range 6 {
		w.mustReach("c1", "default", "webhook", 443, servers[1])
	}
}

// Plain mode: one logical cluster whose namespaces have the same names.
func TestKubeAPIServerPlainMode(t *testing.T) {
	w := newWorld(t)
	ns := w.plainNamespace()
	s := startServer(t, webhookPort)
	w.service(ns, "webhook", intstr.FromInt32(webhookPort))
	w.mustSetEndpoints(ns, "webhook", "webhook-abcde", webhookPort, ready(s.ip)...)
	synced := w.syncedNamespace(w.syncTarget, lookup.NamespaceLocatorAnnotation, "c1", "default")
	w.service(synced, "webhook", intstr.FromInt32(webhookPort))
	w.mustSetEndpoints(synced, "webhook", "webhook-fghij", webhookPort, ready(s.ip)...)

	w.startAgent(lookup.KubeOptions{PlainCluster: "plain"})
	w.mustReach("plain", ns, "webhook", 443, s)
	w.wantRefusal("plain", "missing", "webhook", 443, codes.NotFound)
	// A syncer's namespace is some workspace's, not the plain cluster's.
	w.wantRefusal("plain", synced, "webhook", 443, codes.PermissionDenied)
	// The agent registered only the plain cluster: nobody serves c1.
	w.wantRefusal("c1", "default", "webhook", 443, codes.Unavailable)
}
