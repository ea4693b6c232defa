package kubeapiserver

import (
	"context"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
)

// Whoever may write EndpointSlices in a namespace (and Pods, and Services)
// tries to aim the agent at a kubelet, and at Pods the Service does not
// select: the agent dials only addresses of Pods the Service selects, as the
// EndpointSlice controller lists them, and refuses the rest with the reason;
// in the one namespace the operator trusts, a Service without a selector
// works.
func TestKubeAPIServerDialsOnlyWhatTheControlPlaneVouchesFor(t *testing.T) {
	w := newWorld(t)
	ns := w.syncedNamespace(w.syncTarget, lookup.NamespaceLocatorAnnotation, "c1", "default")
	trusted := w.syncedNamespace(w.syncTarget, lookup.NamespaceLocatorAnnotation, "c1", "trusted")
	kubelet := startServer(t, 10250)         // a node's kubelet
	webhook := startServer(t, webhookPort)   // the webhook's Pod
	bystander := startServer(t, webhookPort) // another Pod of the namespace

	w.stageVouchTargets(ns, trusted, kubelet, webhook, bystander)

	trust, err := lookup.ParseScope("c1/trusted")
	if err != nil {
		t.Fatal(err)
	}
	w.startAgent(lookup.KubeOptions{TrustEndpointSlicesIn: trust})

	// The forged slice beside the controller's is never dialed.
	for range 6 {
		w.mustReach("c1", "default", "webhook", 443, webhook)
	}
	for svc, why := range map[string]string{
		"nosel":      "the Service has no selector",
		"nopod":      "names no Pod",
		"ghost":      "names Pod ghost, which does not exist",
		"stolen":     "is not an address of Pod",
		"unselected": "which the Service does not select",
		"hostnet":    "hostNetwork",
		"manual":     "the Service has no selector",
	} {
		if msg := w.wantRefusal("c1", "default", svc, 443, codes.PermissionDenied); !strings.Contains(msg, why) {
			t.Errorf("%s: the message does not say %q: %s", svc, why, msg)
		}
	}
	w.mustReach("c1", "trusted", "manual", 443, webhook)
}

// stageVouchTargets creates the Services and EndpointSlices of
// TestKubeAPIServerDialsOnlyWhatTheControlPlaneVouchesFor in namespace ns
// (and, for "manual", in trusted too): the webhook's, and every way its
// writers try to aim the agent at the kubelet or at Pods a Service does
// not select.
func (w *world) stageVouchTargets(ns, trusted string, kubelet, webhook, bystander *server) {
	w.t.Helper()
	t := w.t
	// The webhook, as the controller lists it, and beside that a slice
	// with every mark of the controller's (its managed-by label, a
	// controller owner reference to the Service with its real UID) that
	// someone else wrote, aimed at the kubelet.
	w.service(ns, "webhook", intstr.FromInt32(webhookPort))
	w.mustSetEndpoints(ns, "webhook", "webhook-abcde", webhookPort, ready(webhook.ip)...)
	w.forge(ns, "webhook", "webhook-forged", kubelet.ip, 10250, "")
	// The reported attack: a Service without a selector, whose only slice
	// claims to be the controller's.
	w.selectorlessService(ns, "nosel", intstr.FromInt32(10250))
	if err := w.setEndpoints(ns, "nosel", "nosel-abcde", lookup.EndpointSliceController, 10250, ready(kubelet.ip)...); err != nil {
		t.Fatal(err)
	}
	// Forged owner references on slices whose endpoints are not a
	// selected Pod's: one names no Pod, one a Pod that does not exist,
	// one the webhook's Pod (which "stolen" selects) at the kubelet's
	// address, one a Pod the Service does not select.
	for _, name := range []string{"nopod", "ghost", "unselected"} {
		w.service(ns, name, intstr.FromInt32(10250))
	}
	w.service(ns, "stolen", intstr.FromInt32(10250))
	w.setSelector(ns, "stolen", map[string]string{"app": "webhook"})
	w.forge(ns, "nopod", "nopod-abcde", kubelet.ip, 10250, "")
	w.forge(ns, "ghost", "ghost-abcde", kubelet.ip, 10250, "ghost")
	w.forge(ns, "stolen", "stolen-abcde", kubelet.ip, 10250, "pod-"+strings.ReplaceAll(webhook.ip, ".", "-"))
	other := w.pod(ns, map[string]string{"app": "bystander"}, bystander.ip, false)
	w.forge(ns, "unselected", "unselected-abcde", bystander.ip, webhookPort, other.Name)
	// A hostNetwork Pod the Service selects, as the controller lists it:
	// its address is its node's.
	w.service(ns, "hostnet", intstr.FromInt32(10250))
	hostPod := w.pod(ns, map[string]string{"app": "hostnet"}, kubelet.ip, true)
	w.controllerSlice(ns, "hostnet", "hostnet-abcde", 10250, hostPod)
	// Services without a selector in the trusted namespace and in the
	// other one, their hand-written slices aimed at the webhook.
	for _, n := range []string{ns, trusted} {
		w.selectorlessService(n, "manual", intstr.FromInt32(webhookPort))
		if err := w.setEndpoints(n, "manual", "manual", "staff", webhookPort, ready(webhook.ip)...); err != nil {
			t.Fatal(err)
		}
	}
}

// selectorlessService creates a Service like world.service, without a
// selector: the EndpointSlice controller writes no slices for it.
func (w *world) selectorlessService(ns, name string, targetPort intstr.IntOrString) {
	w.t.Helper()
	w.service(ns, name, targetPort)
	w.setSelector(ns, name, nil)
}

func (w *world) setSelector(ns, name string, selector map[string]string) {
	w.t.Helper()
	services := w.admin.CoreV1().Services(ns)
	svc, err := services.Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		w.t.Fatal(err)
	}
	svc.Spec.Selector = selector
	if _, err := services.Update(context.Background(), svc, metav1.UpdateOptions{}); err != nil {
		w.t.Fatal(err)
	}
}

// forge writes, as anyone who may write EndpointSlices can, a slice of
// Service svc with every mark of the controller's: its managed-by label
// and a controller owner reference to the Service, with its real UID. Its
// one ready endpoint is at ip and names the Pod pod of ns, or none if "".
func (w *world) forge(ns, svc, name, ip string, port int32, pod string) {
	w.t.Helper()
	service, err := w.admin.CoreV1().Services(ns).Get(context.Background(), svc, metav1.GetOptions{})
	if err != nil {
		w.t.Fatal(err)
	}
	slice := newSlice(svc, name, lookup.EndpointSliceController, port, ready(ip)...)
	slice.OwnerReferences = []metav1.OwnerReference{*metav1.NewControllerRef(service, corev1.SchemeGroupVersion.WithKind("Service"))}
	if pod != "" {
		slice.Endpoints[0].TargetRef = &corev1.ObjectReference{Kind: "Pod", Namespace: ns, Name: pod}
	}
	if err := w.writeSlice(ns, slice); err != nil {
		w.t.Fatal(err)
	}
}

// controllerSlice writes the slice the EndpointSlice controller writes for
// Service svc and the Pod pod, which it selects.
func (w *world) controllerSlice(ns, svc, name string, port int32, pod *corev1.Pod) {
	w.t.Helper()
	w.forge(ns, svc, name, pod.Status.PodIP, port, pod.Name)
}
