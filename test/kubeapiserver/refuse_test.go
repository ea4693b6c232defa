package kubeapiserver

import (
	"context"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// Every target the agent must not connect to is refused with a status that
// says so, though the API server accepted what names it.
func TestKubeAPIServerRefusesTargets(t *testing.T) {
	w := newWorld(t)
	ns := w.syncedNamespace(w.syncTarget, lookup.NamespaceLocatorAnnotation, "c1", "default")
	other := w.syncedNamespace(w.syncTarget, lookup.NamespaceLocatorAnnotation, "c2", "default")
	otherTarget := lookup.SyncTarget{Name: "st", Cluster: "stws", UID: w.syncTarget.UID + "-other"}
	foreign := w.syncedNamespace(otherTarget, lookup.NamespaceLocatorAnnotation, "c1", "foreign")
	foreignOnly := w.syncedNamespace(otherTarget, lookup.NamespaceLocatorAnnotation, "c9", "default")
	live := startServer(t, webhookPort)
	w.stageRefusedTargets(ns, live)
	// Services that exist, but in namespaces of another cluster, or of
	// another sync target.
	for _, n := range []string{other, foreign, foreignOnly} {
		w.service(n, "secret", intstr.FromInt32(webhookPort))
		w.mustSetEndpoints(n, "secret", "secret-abcde", webhookPort, ready(live.ip)...)
	}

	w.startAgent(lookup.KubeOptions{})

	for _, c := range []struct{ svc, why string }{
		{"external", "ExternalName"},
		{"apiserver", "API server"},
		{"multicast", "multicast"},
		{"handmade", "not managed by"},
	} {
		if msg := w.wantRefusal("c1", "default", c.svc, 443, codes.PermissionDenied); !strings.Contains(msg, c.why) {
			t.Errorf("message does not say why: %s", msg)
		}
	}
	// c2's Service is not c1's, though the agent serves both.
	w.wantRefusal("c1", "default", "secret", 443, codes.NotFound)
	w.mustReach("c2", "default", "secret", 443, live)
	// Another sync target's namespace: not mapped, for a cluster this agent
	// serves or one it does not (then no agent serves it at all).
	w.wantRefusal("c1", "foreign", "secret", 443, codes.NotFound)
	w.wantRefusal("c9", "default", "secret", 443, codes.Unavailable)
	// Downstream namespace names are not upstream ones.
	w.wantRefusal("c1", other, "secret", 443, codes.NotFound)
	w.wantRefusal("c1", foreign, "secret", 443, codes.NotFound)
}

// stageRefusedTargets creates, in namespace ns, Services the API server
// accepts and the agent must refuse to dial: external, apiserver,
// multicast and handmade (whose hand-made slice aims at live).
func (w *world) stageRefusedTargets(ns string, live *server) {
	w.t.Helper()
	t, ctx := w.t, context.Background()
	// ExternalName: the agent would connect wherever DNS says.
	if _, err := w.admin.CoreV1().Services(ns).Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "external"},
		Spec: corev1.ServiceSpec{Type: corev1.ServiceTypeExternalName, ExternalName: "example.com",
			Ports: []corev1.ServicePort{{Name: "https", Port: 443}}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// An endpoint at the API server's own address.
	w.service(ns, "apiserver", intstr.FromInt32(6443))
	w.mustSetEndpoints(ns, "apiserver", "apiserver-abcde", 6443, ready(harness.IsolatedAPIServerIP)...)
	// A multicast endpoint: the API server takes it, the agent does not.
	w.service(ns, "multicast", intstr.FromInt32(webhookPort))
	w.mustSetEndpoints(ns, "multicast", "multicast-abcde", webhookPort, ready("239.1.2.3")...)
	// A hand-made EndpointSlice, as a tenant might get synced, aiming at a
	// live listener: untrusted by default.
	w.service(ns, "handmade", intstr.FromInt32(webhookPort))
	if err := w.setEndpoints(ns, "handmade", "handmade", "tenant", webhookPort, ready(live.ip)...); err != nil {
		t.Fatal(err)
	}
}

// The API server itself refuses loopback, link-local and unspecified
// endpoint addresses, managed or not; the agent's refusal of those is
// proven by the lookup package's unit tests.
func TestKubeAPIServerRejectsLocalEndpointAddresses(t *testing.T) {
	w := newWorld(t)
	ns := w.syncedNamespace(w.syncTarget, lookup.NamespaceLocatorAnnotation, "c1", "default")
	w.service(ns, "webhook", intstr.FromInt32(webhookPort))
	for _, ip := range []string{"127.0.0.1", "169.254.169.254", "0.0.0.0"} {
		for _, managedBy := range []string{lookup.EndpointSliceController, "tenant"} {
			err := w.setEndpoints(ns, "webhook", "webhook-abcde", managedBy, webhookPort, ready(ip)...)
			if !apierrors.IsInvalid(err) {
				t.Errorf("EndpointSlice with %s (managed by %s): got %v, want Invalid", ip, managedBy, err)
			}
		}
	}
}
