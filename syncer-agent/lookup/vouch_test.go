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
	for _, c := range slices.Concat(
		vouchedCases(),
		selectorlessCases(),
		uncontrolledSliceCases(),
		unvouchedEndpointCases(),
		unservingPodCases(),
		addressRuleCases(),
	) {
		t.Run(c.name, c.check)
	}
}

const (
	vouchedPodIP = "10.1.0.1"
	kubeletIP    = "10.0.0.17" // a node: what an attacker would aim at
)

// vouchCase is one world of TestKubeDialsOnlyWhatTheControlPlaneVouchesFor
// and what the agent must dial in it.
type vouchCase struct {
	name   string
	trust  string // --trust-endpointslices-in
	svc    *corev1.Service
	slices []*discoveryv1.EndpointSlice
	pods   []*corev1.Pod
	want   []string // dialed, or nil for refused
	why    string   // in the PermissionDenied message
}

// objects is the case's world as the API server holds it: the synced
// namespace, the Service (the webhook Service on 8443 unless the case
// names another) and copies of the case's slices and Pods, so that no
// case sees what another did to a shared one.
func (c vouchCase) objects() []runtime.Object {
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
	return objs
}

// check resolves the webhook in the case's world and wants either exactly
// the addresses the case names, or a refusal that gives its reason and,
// where nothing is trusted, says how an operator could trust the slices.
func (c vouchCase) check(t *testing.T) {
	k, _ := startKube(t, KubeOptions{SyncTarget: ownTarget, TrustEndpointSlicesIn: mustParseScope(t, c.trust)}, c.objects()...)
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
}

// goodSlice is the slice the controller writes for the selected Pod at
// vouchedPodIP, and goodPod that Pod.
func goodSlice() *discoveryv1.EndpointSlice { return webhookSlice("s1", 8443, ready(vouchedPodIP)) }
func goodPod() *corev1.Pod                  { return pod("kcp-a", "webhook", vouchedPodIP) }

// selectorlessWebhook is the webhook Service without a selector, aimed at
// the kubelet's port.
func selectorlessWebhook() *corev1.Service {
	svc := webhookService(intstr.FromInt32(10250))
	svc.Spec.Selector = nil
	return svc
}

// handWrittenSlice is a slice as anyone who may write EndpointSlices
// writes it: the controller's managed-by label, no owner, no Pod.
func handWrittenSlice() *discoveryv1.EndpointSlice {
	s := webhookSlice("forged", 10250, ready(kubeletIP))
	s.OwnerReferences = nil
	s.Endpoints[0].TargetRef = nil
	return s
}

// forgedSlice is a slice with everything the controller writes on it, the
// Service's real UID included, aimed at the kubelet.
func forgedSlice(ref *corev1.ObjectReference) *discoveryv1.EndpointSlice {
	s := webhookSlice("forged", 10250, ready(kubeletIP))
	s.Endpoints[0].TargetRef = ref
	return s
}

// goodSliceWith is goodSlice after mutate has changed it.
func goodSliceWith(mutate func(*discoveryv1.EndpointSlice)) *discoveryv1.EndpointSlice {
	s := goodSlice()
	mutate(s)
	return s
}

// goodSliceOwnedBy is goodSlice after mutate has changed its owner.
func goodSliceOwnedBy(mutate func(*metav1.OwnerReference)) *discoveryv1.EndpointSlice {
	s := goodSlice()
	mutate(&s.OwnerReferences[0])
	return s
}

// goodPodWith is goodPod, alone, after mutate has changed it.
func goodPodWith(mutate func(*corev1.Pod)) []*corev1.Pod {
	p := goodPod()
	mutate(p)
	return []*corev1.Pod{p}
}

// vouchedCases are worlds where the controller vouches for what is dialed.
func vouchedCases() []vouchCase {
	return []vouchCase{
		{name: "a selected Pod in a slice the controller owns",
			slices: []*discoveryv1.EndpointSlice{goodSlice()}, pods: []*corev1.Pod{goodPod()}, want: []string{"10.1.0.1:8443"}},
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
			slices: []*discoveryv1.EndpointSlice{goodSlice(), forgedSlice(nil)}, pods: []*corev1.Pod{goodPod()}, want: []string{"10.1.0.1:8443"}},
	}
}

// selectorlessCases are Services without a selector: nothing vouches for
// their slices, so only trust lets the agent dial them.
func selectorlessCases() []vouchCase {
	return []vouchCase{
		{name: "a Service without a selector, with a hand-written slice",
			svc: selectorlessWebhook(), slices: []*discoveryv1.EndpointSlice{handWrittenSlice()}, why: "has no selector"},
		{name: "a Service without a selector and no slices",
			svc: selectorlessWebhook(), why: "has no selector"},
		{name: "a Service without a selector, its namespace trusted",
			trust: "c1/default", svc: selectorlessWebhook(), slices: []*discoveryv1.EndpointSlice{handWrittenSlice()}, want: []string{"10.0.0.17:10250"}},
		{name: "a Service without a selector, its cluster trusted",
			trust: "c1", svc: selectorlessWebhook(), slices: []*discoveryv1.EndpointSlice{handWrittenSlice()}, want: []string{"10.0.0.17:10250"}},
		{name: "a Service without a selector, everything trusted",
			trust: "*", svc: selectorlessWebhook(), slices: []*discoveryv1.EndpointSlice{handWrittenSlice()}, want: []string{"10.0.0.17:10250"}},
		{name: "a Service without a selector, other namespaces trusted",
			trust: "c1/other,c2", svc: selectorlessWebhook(), slices: []*discoveryv1.EndpointSlice{handWrittenSlice()}, why: "has no selector"},
	}
}

// uncontrolledSliceCases are slices the controller did not write.
func uncontrolledSliceCases() []vouchCase {
	return []vouchCase{
		{name: "a slice managed by someone else",
			slices: []*discoveryv1.EndpointSlice{goodSliceWith(func(s *discoveryv1.EndpointSlice) {
				s.Labels[discoveryv1.LabelManagedBy] = "tenant"
			})},
			pods: []*corev1.Pod{goodPod()}, why: "EndpointSlice s1 is not managed by endpointslice-controller.k8s.io"},
		{name: "a slice without a managed-by label",
			slices: []*discoveryv1.EndpointSlice{goodSliceWith(func(s *discoveryv1.EndpointSlice) {
				delete(s.Labels, discoveryv1.LabelManagedBy)
			})},
			pods: []*corev1.Pod{goodPod()}, why: "not managed by"},
		{name: "a slice without an owner",
			slices: []*discoveryv1.EndpointSlice{goodSliceWith(func(s *discoveryv1.EndpointSlice) {
				s.OwnerReferences = nil
			})},
			pods: []*corev1.Pod{goodPod()}, why: "not owned by the Service"},
		{name: "a slice of an earlier Service of the same name",
			slices: []*discoveryv1.EndpointSlice{goodSliceOwnedBy(func(o *metav1.OwnerReference) { o.UID = "uid-of-the-earlier-one" })},
			pods:   []*corev1.Pod{goodPod()}, why: "not owned by the Service"},
		{name: "a slice the Service owns but does not control",
			slices: []*discoveryv1.EndpointSlice{goodSliceOwnedBy(func(o *metav1.OwnerReference) { o.Controller = nil })},
			pods:   []*corev1.Pod{goodPod()}, why: "not owned by the Service"},
		{name: "a slice controlled by something else of the Service's name and UID",
			slices: []*discoveryv1.EndpointSlice{goodSliceOwnedBy(func(o *metav1.OwnerReference) { o.APIVersion, o.Kind = "apps/v1", "Deployment" })},
			pods:   []*corev1.Pod{goodPod()}, why: "not owned by the Service"},
	}
}

// unvouchedEndpointCases are slices with every mark of the controller's,
// the Service's real UID included, whose endpoints are not a selected
// Pod's.
func unvouchedEndpointCases() []vouchCase {
	return []vouchCase{
		{name: "an endpoint that names no Pod",
			slices: []*discoveryv1.EndpointSlice{forgedSlice(nil)}, why: "10.0.0.17 of EndpointSlice forged names no Pod"},
		{name: "an endpoint that names a Node",
			slices: []*discoveryv1.EndpointSlice{forgedSlice(&corev1.ObjectReference{Kind: "Node", Name: "node-1"})}, why: "names no Pod"},
		{name: "an endpoint that names a Pod of another namespace",
			slices: []*discoveryv1.EndpointSlice{forgedSlice(&corev1.ObjectReference{Kind: "Pod", Namespace: "kcp-b", Name: podName(kubeletIP)})},
			pods:   []*corev1.Pod{pod("kcp-b", "webhook", kubeletIP)}, why: "names Pod kcp-b/pod-10-0-0-17, not one of the Service's namespace"},
		{name: "an endpoint that names a Pod that does not exist",
			slices: []*discoveryv1.EndpointSlice{forgedSlice(&corev1.ObjectReference{Kind: "Pod", Namespace: "kcp-a", Name: "ghost"})},
			why:    "names Pod ghost, which does not exist"},
		{name: "an endpoint that names a Pod the Service does not select",
			slices: []*discoveryv1.EndpointSlice{goodSlice()}, pods: []*corev1.Pod{pod("kcp-a", "other", vouchedPodIP)},
			why: "which the Service does not select"},
		{name: "an endpoint that names a selected Pod, at another address",
			slices: []*discoveryv1.EndpointSlice{forgedSlice(&corev1.ObjectReference{Kind: "Pod", Namespace: "kcp-a", Name: goodPod().Name})},
			pods:   []*corev1.Pod{goodPod()}, why: "10.0.0.17 of EndpointSlice forged is not an address of Pod pod-10-1-0-1"},
	}
}

// unservingPodCases are Pods whose address is not theirs to serve on.
func unservingPodCases() []vouchCase {
	now := metav1.Now()
	return []vouchCase{
		{name: "a hostNetwork Pod, whose address is its node's",
			slices: []*discoveryv1.EndpointSlice{goodSlice()}, pods: goodPodWith(func(p *corev1.Pod) { p.Spec.HostNetwork = true }),
			why: "uses its node's network"},
		{name: "a hostNetwork Pod in a trusted namespace",
			trust: "c1/default", slices: []*discoveryv1.EndpointSlice{goodSlice()}, pods: goodPodWith(func(p *corev1.Pod) { p.Spec.HostNetwork = true }),
			want: []string{"10.1.0.1:8443"}},
		{name: "a Pod that succeeded",
			slices: []*discoveryv1.EndpointSlice{goodSlice()}, pods: goodPodWith(func(p *corev1.Pod) { p.Status.Phase = corev1.PodSucceeded }),
			why: "which has ended"},
		{name: "a Pod that failed",
			slices: []*discoveryv1.EndpointSlice{goodSlice()}, pods: goodPodWith(func(p *corev1.Pod) { p.Status.Phase = corev1.PodFailed }),
			why: "which has ended"},
		{name: "a Pod being deleted",
			slices: []*discoveryv1.EndpointSlice{goodSlice()}, pods: goodPodWith(func(p *corev1.Pod) {
				p.DeletionTimestamp, p.Finalizers = &now, []string{"example.com/keep"}
			}),
			why: "which is being deleted"},
	}
}

// addressRuleCases show that trusting a namespace's slices lifts none of
// the address rules.
func addressRuleCases() []vouchCase {
	return []vouchCase{
		{name: "a loopback address in a trusted namespace",
			trust: "*", svc: selectorlessWebhook(), slices: []*discoveryv1.EndpointSlice{webhookSlice("s1", 10250, ready("127.0.0.1"))},
			why: "127.0.0.1:10250 is a loopback address"},
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
