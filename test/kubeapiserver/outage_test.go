package kubeapiserver

import (
	"testing"

	"google.golang.org/grpc/codes"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
)

// While the API server is down the agent serves from its caches; when it is
// back, the agent's informers reconnect by themselves and follow changes.
func TestKubeAPIServerOutageServesFromCache(t *testing.T) {
	w := newWorld(t)
	ns := w.syncedNamespace(w.syncTarget, lookup.NamespaceLocatorAnnotation, "c1", "default")
	before, after := startServer(t, webhookPort), startServer(t, webhookPort)
	w.service(ns, "webhook", intstr.FromInt32(webhookPort))
	w.mustSetEndpoints(ns, "webhook", "webhook-abcde", webhookPort, ready(before.ip)...)
	w.startAgent(lookup.KubeOptions{})
	w.mustReach("c1", "default", "webhook", 443, before)

	if err := w.kube.StopAPIServer(); err != nil {
		t.Fatal(err)
	}
	// Whatever happens below, the next test gets its API server back.
	restarted := false
	t.Cleanup(func() {
		if !restarted {
			if err := w.kube.StartAPIServer(); err != nil {
				t.Error(err)
			}
		}
	})
	for range 5 {
		w.mustReach("c1", "default", "webhook", 443, before)
	}
	w.wantRefusal("c1", "default", "missing", 443, codes.NotFound)

	if err := w.kube.StartAPIServer(); err != nil {
		t.Fatal(err)
	}
	restarted = true
	w.mustSetEndpoints(ns, "webhook", "webhook-abcde", webhookPort, ready(after.ip)...)
	w.eventuallyReach("c1", "default", "webhook", 443, after)
}
