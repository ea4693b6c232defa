package lookup

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// What the agent dials for c1/default/webhook:443 (namespace kcp-a), by
// default and where the operator trusts EndpointSlices as written: only
// addresses of Pods the Service selects, from slices the EndpointSlice
// controller owns, unless trusted; everything else is PermissionDenied
// with the reason.
func TestKubeDialsOnlyWhatTheControlPlaneVouchesFor(t *testing.T) {
	const (
		podIP   = "10.1.0.1"
		kubelet = "10.0.0.17" // a node: what an attacker would aim at
	)
	selectorless := func() *corev1.Service {
		svc := webhookService(intstr.FromInt32(10250))
		svc.Spec.Selector = nil
		return svc
	}
	// handWritten is a slice as anyone who may write EndpointSlices writes
	// it: the controller's managed-by label, no owner, no Pod.
	handWritten := func() *discoveryv1.EndpointSlice {
		s := webhookSlice("forged", 10250, ready(kubelet))
		s.OwnerReferences = nil
		s.Endpoints[0].TargetRef = nil
		return s
	}
	// forged is a slice with everything the controller writes on it, the
	// Service's real UID included, aimed at the kubelet.
	forged := func(ref *corev1.ObjectReference) *discoveryv1.EndpointSlice {
		s := webhookSlice("forged", 10250, ready(kubelet))
		s.Endpoints[0].TargetRef = ref
		return s
	}
	withOwner := func(mutate func(*metav1.OwnerReference)) *discoveryv1.EndpointSlice {
		s := webhookSlice("s1", 8443, ready(podIP))
		mutate(&s.OwnerReferences[0])
		return s
	}
	withPod := func(mutate func(*corev1.Pod)) []*corev1.Pod {
		p := pod("kcp-a", "webhook", podIP)
		mutate(p)
		return []*corev1.Pod{p}
	}
	now := metav1.Now()
	good := webhookSlice("s1", 8443, ready(podIP))
	goodPod := pod("kcp-a", "webhook", podIP)

	for _, c := range []struct {
		name   string
		trust  string // --trust-endpointslices-in
		svc    *corev1.Service
		slices []*discoveryv1.EndpointSlice
		pods   []*corev1.Pod
		want   []string // dialed, or nil for refused
		why    string   // in the PermissionDenied message
	}{
		{name: "a selected Pod in a slice the controller owns",
			slices: []*discoveryv1.EndpointSlice{good}, pods: []*corev1.Pod{goodPod}, want: []string{"10.1.0.1:8443"}},
		{name: "a selected Pod's IPv6 address, written another way",
			slices: []*discoveryv1.EndpointSlice{func() *discoveryv1.EndpointSlice {
				s := webhookSlice("s1", 8443, ready("2001:db8:0:0::1"))
				s.AddressType = discoveryv1.AddressTypeIPv6
				return s
			}()},
			pods: []*corev1.Pod{func() *corev1.Pod {
				p := pod("kcp-a", "webhook", "2001:db8::1")
				p.Name = podName("2001:db8:0:0::1")
				return p
			}()},
			want: []string{"[2001:db8::1]:8443"}},
		{name: "forged endpoints beside vouched ones are left out",
			slices: []*discoveryv1.EndpointSlice{good, forged(nil)}, pods: []*corev1.Pod{goodPod}, want: []string{"10.1.0.1:8443"}},

		// Services without a selector: nothing vouches for their slices.
		{name: "a Service without a selector, with a hand-written slice",
			svc: selectorless(), slices: []*discoveryv1.EndpointSlice{handWritten()}, why: "has no selector"},
		{name: "a Service without a selector and no slices",
			svc: selectorless(), why: "has no selector"},
		{name: "a Service without a selector, its namespace trusted",
			trust: "c1/default", svc: selectorless(), slices: []*discoveryv1.EndpointSlice{handWritten()}, want: []string{"10.0.0.17:10250"}},
		{name: "a Service without a selector, its cluster trusted",
			trust: "c1", svc: selectorless(), slices: []*discoveryv1.EndpointSlice{handWritten()}, want: []string{"10.0.0.17:10250"}},
		{name: "a Service without a selector, everything trusted",
			trust: "*", svc: selectorless(), slices: []*discoveryv1.EndpointSlice{handWritten()}, want: []string{"10.0.0.17:10250"}},
		{name: "a Service without a selector, other namespaces trusted",
			trust: "c1/other,c2", svc: selectorless(), slices: []*discoveryv1.EndpointSlice{handWritten()}, why: "has no selector"},

		// Slices the controller did not write.
		{name: "a slice managed by someone else",
			slices: []*discoveryv1.EndpointSlice{func() *discoveryv1.EndpointSlice {
				s := webhookSlice("s1", 8443, ready(podIP))
				s.Labels[discoveryv1.LabelManagedBy] = "tenant"
				return s
			}()},
			pods: []*corev1.Pod{goodPod}, why: "EndpointSlice s1 is not managed by endpointslice-controller.k8s.io"},
		{name: "a slice without a managed-by label",
			slices: []*discoveryv1.EndpointSlice{func() *discoveryv1.EndpointSlice {
				s := webhookSlice("s1", 8443, ready(podIP))
				delete(s.Labels, discoveryv1.LabelManagedBy)
				return s
			}()},
			pods: []*corev1.Pod{goodPod}, why: "not managed by"},
		{name: "a slice without an owner",
			slices: []*discoveryv1.EndpointSlice{func() *discoveryv1.EndpointSlice {
				s := webhookSlice("s1", 8443, ready(podIP))
				s.OwnerReferences = nil
				return s
			}()},
			pods: []*corev1.Pod{goodPod}, why: "not owned by the Service"},
		{name: "a slice of an earlier Service of the same name",
			slices: []*discoveryv1.EndpointSlice{withOwner(func(o *metav1.OwnerReference) { o.UID = "uid-of-the-earlier-one" })},
			pods:   []*corev1.Pod{goodPod}, why: "not owned by the Service"},
		{name: "a slice the Service owns but does not control",
			slices: []*discoveryv1.EndpointSlice{withOwner(func(o *metav1.OwnerReference) { o.Controller = nil })},
			pods:   []*corev1.Pod{goodPod}, why: "not owned by the Service"},
		{name: "a slice controlled by something else of the Service's name and UID",
			slices: []*discoveryv1.EndpointSlice{withOwner(func(o *metav1.OwnerReference) { o.APIVersion, o.Kind = "apps/v1", "Deployment" })},
			pods:   []*corev1.Pod{goodPod}, why: "not owned by the Service"},

		// Slices with every mark of the controller's, the Service's real
		// UID included, whose endpoints are not a selected Pod's.
		{name: "an endpoint that names no Pod",
			slices: []*discoveryv1.EndpointSlice{forged(nil)}, why: "10.0.0.17 of EndpointSlice forged names no Pod"},
		{name: "an endpoint that names a Node",
			slices: []*discoveryv1.EndpointSlice{forged(&corev1.ObjectReference{Kind: "Node", Name: "node-1"})}, why: "names no Pod"},
		{name: "an endpoint that names a Pod of another namespace",
			slices: []*discoveryv1.EndpointSlice{forged(&corev1.ObjectReference{Kind: "Pod", Namespace: "kcp-b", Name: podName(kubelet)})},
			pods:   []*corev1.Pod{pod("kcp-b", "webhook", kubelet)}, why: "names Pod kcp-b/pod-10-0-0-17, not one of the Service's namespace"},
		{name: "an endpoint that names a Pod that does not exist",
			slices: []*discoveryv1.EndpointSlice{forged(&corev1.ObjectReference{Kind: "Pod", Namespace: "kcp-a", Name: "ghost"})},
			why:    "names Pod ghost, which does not exist"},
		{name: "an endpoint that names a Pod the Service does not select",
			slices: []*discoveryv1.EndpointSlice{webhookSlice("s1", 8443, ready(podIP))}, pods: []*corev1.Pod{pod("kcp-a", "other", podIP)},
			why: "which the Service does not select"},
		{name: "an endpoint that names a selected Pod, at another address",
			slices: []*discoveryv1.EndpointSlice{forged(&corev1.ObjectReference{Kind: "Pod", Namespace: "kcp-a", Name: goodPod.Name})},
			pods:   []*corev1.Pod{goodPod}, why: "10.0.0.17 of EndpointSlice forged is not an address of Pod pod-10-1-0-1"},

		// Pods whose address is not theirs to serve on.
		{name: "a hostNetwork Pod, whose address is its node's",
			slices: []*discoveryv1.EndpointSlice{good}, pods: withPod(func(p *corev1.Pod) { p.Spec.HostNetwork = true }),
			why: "uses its node's network"},
		{name: "a hostNetwork Pod in a trusted namespace",
			trust: "c1/default", slices: []*discoveryv1.EndpointSlice{good}, pods: withPod(func(p *corev1.Pod) { p.Spec.HostNetwork = true }),
			want: []string{"10.1.0.1:8443"}},
		{name: "a Pod that succeeded",
			slices: []*discoveryv1.EndpointSlice{good}, pods: withPod(func(p *corev1.Pod) { p.Status.Phase = corev1.PodSucceeded }),
			why: "which has ended"},
		{name: "a Pod that failed",
			slices: []*discoveryv1.EndpointSlice{good}, pods: withPod(func(p *corev1.Pod) { p.Status.Phase = corev1.PodFailed }),
			why: "which has ended"},
		{name: "a Pod being deleted",
			slices: []*discoveryv1.EndpointSlice{good}, pods: withPod(func(p *corev1.Pod) {
				p.DeletionTimestamp, p.Finalizers = &now, []string{"example.com/keep"}
			}),
			why: "which is being deleted"},

		// Trusting a namespace's slices lifts none of the address rules.
		{name: "a loopback address in a trusted namespace",
			trust: "*", svc: selectorless(), slices: []*discoveryv1.EndpointSlice{webhookSlice("s1", 10250, ready("127.0.0.1"))},
			why: "127.0.0.1:10250 is a loopback address"},
	} {
		t.Run(c.name, func(t *testing.T) {
			svc := c.svc
			if svc == nil {
				svc = webhookService(intstr.FromInt32(8443))
			}
			objs := []runtime.Object{syncedNamespace("kcp-a", "c1", "default"), svc}
			for _, s := range c.slices {
				objs = append(objs, s.DeepCopy())
			}
			for _, p := range c.pods {
				objs = append(objs, p.DeepCopy())
			}
			k, _ := startKube(t, KubeOptions{SyncTarget: ownTarget, TrustEndpointSlicesIn: mustParseScope(t, c.trust)}, objs...)
			addrs, err := k.Resolve(t.Context(), target("c1", "default", "webhook", 443))
			if c.want != nil {
				if err != nil || !slices.Equal(addrs, c.want) {
					t.Fatalf("got %v, %v; want %v", addrs, err, c.want)
				}
				return
			}
			if status.Code(err) != codes.PermissionDenied || !strings.Contains(status.Convert(err).Message(), c.why) {
				t.Fatalf("got %v, %v; want PermissionDenied saying %q", addrs, err, c.why)
			}
			if c.trust == "" && !strings.Contains(err.Error(), "--trust-endpointslices-in") {
				t.Errorf("the message does not say how an operator may trust the slices: %v", err)
			}
			t.Log(err)
		})
	}
}

// Whoever writes a Service's EndpointSlices decides how many reasons there
// are to refuse them: the message names a few, not all.
func TestKubeRefusalMessageIsBounded(t *testing.T) {
	var forged []*discoveryv1.EndpointSlice
	for i := range 200 {
		s := webhookSlice(fmt.Sprintf("forged-%03d", i), 8443, ready(fmt.Sprintf("10.2.%d.%d", i/200, i%200)))
		s.Labels[discoveryv1.LabelManagedBy] = "tenant"
		forged = append(forged, s)
	}
	_, _, err := resolveWebhook(t, KubeOptions{}, webhookService(intstr.FromInt32(8443)), forged...)
	msg := status.Convert(err).Message()
	if status.Code(err) != codes.PermissionDenied || !strings.Contains(msg, "and 195 more") {
		t.Fatalf("got %v; want PermissionDenied naming 5 reasons and 195 more", err)
	}
	if len(msg) > 2000 {
		t.Errorf("message of %d bytes: %s", len(msg), msg)
	}
	t.Log(msg)
}
