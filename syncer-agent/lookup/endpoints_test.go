package lookup

import (
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// resolveWebhook resolves c1/default/webhook:443 against a namespace kcp-a
// mapped to it, the given Service and slices, and the Pods the slices name
// (podsOf).
func resolveWebhook(t *testing.T, opts KubeOptions, svc *corev1.Service, slices ...*discoveryv1.EndpointSlice) (*Kube, []string, error) {
	t.Helper()
	opts.SyncTarget = ownTarget
	objs := append([]runtime.Object{syncedNamespace("kcp-a", "c1", "default"), svc}, podsOf(svc, slices...)...)
	for _, s := range slices {
		objs = append(objs, s)
	}
	k, _ := startKube(t, opts, objs...)
	addrs, err := k.Resolve(t.Context(), target("c1", "default", "webhook", 443))
	return k, addrs, err
}

func webhookService(targetPort intstr.IntOrString) *corev1.Service {
	return service("kcp-a", "webhook", "https", 443, targetPort)
}

func webhookSlice(name string, port int32, eps ...discoveryv1.Endpoint) *discoveryv1.EndpointSlice {
	return endpointSlice("kcp-a", "webhook", name, "https", port, eps...)
}

func TestKubeNumericTargetPort(t *testing.T) {
	_, addrs, err := resolveWebhook(t, KubeOptions{}, webhookService(intstr.FromInt32(8443)), webhookSlice("s1", 8443, ready("10.1.0.1")))
	if err != nil || !slices.Equal(addrs, []string{"10.1.0.1:8443"}) {
		t.Fatalf("got %v, %v", addrs, err)
	}
}

// A named targetPort is resolved per pod by the EndpointSlice controller,
// which files the number under the Service port's name; other ports of the
// slice are not used.
func TestKubeNamedTargetPort(t *testing.T) {
	svc := webhookService(intstr.FromString("webhook-tls"))
	svc.Spec.Ports = append(svc.Spec.Ports, corev1.ServicePort{Name: "metrics", Port: 9090, TargetPort: intstr.FromString("metrics")})
	slice := webhookSlice("s1", 9443, ready("10.1.0.1"))
	metricsName, metricsPort := "metrics", int32(9091)
	slice.Ports = append([]discoveryv1.EndpointPort{{Name: &metricsName, Port: &metricsPort}}, slice.Ports...)
	// Pods of another revision name the port differently: a slice of their own.
	newer := webhookSlice("s2", 10443, ready("10.1.0.2"))
	_, addrs, err := resolveWebhook(t, KubeOptions{}, svc, slice, newer)
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(addrs)
	if want := []string{"10.1.0.1:9443", "10.1.0.2:10443"}; !slices.Equal(addrs, want) {
		t.Fatalf("got %v, want %v", addrs, want)
	}
}

// An unnamed single port matches an unnamed slice port.
func TestKubeUnnamedPort(t *testing.T) {
	svc := service("kcp-a", "webhook", "", 443, intstr.FromInt32(8443))
	slice := endpointSlice("kcp-a", "webhook", "s1", "", 8443, ready("10.1.0.1"))
	slice.Ports[0].Name = nil
	_, addrs, err := resolveWebhook(t, KubeOptions{}, svc, slice)
	if err != nil || !slices.Equal(addrs, []string{"10.1.0.1:8443"}) {
		t.Fatalf("got %v, %v", addrs, err)
	}
}

func TestKubeUnreadyEndpoints(t *testing.T) {
	no, yes := false, true
	notReady := discoveryv1.Endpoint{Addresses: []string{"10.1.0.1"}, Conditions: discoveryv1.EndpointConditions{Ready: &no, Serving: &no}}
	notServing := discoveryv1.Endpoint{Addresses: []string{"10.1.0.2"}, Conditions: discoveryv1.EndpointConditions{Ready: &yes, Serving: &no}}
	terminating := discoveryv1.Endpoint{Addresses: []string{"10.1.0.3"}, Conditions: discoveryv1.EndpointConditions{Ready: &no, Serving: &yes, Terminating: &yes}}
	unset := ready("10.1.0.4")
	unset.Conditions = discoveryv1.EndpointConditions{} // nil conditions mean ready

	_, _, err := resolveWebhook(t, KubeOptions{}, webhookService(intstr.FromInt32(8443)), webhookSlice("s1", 8443, notReady, notServing, terminating))
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("got %v, want Unavailable", err)
	}
	t.Log(err)

	_, addrs, err := resolveWebhook(t, KubeOptions{}, webhookService(intstr.FromInt32(8443)),
		webhookSlice("s1", 8443, notReady, ready("10.1.0.5"), terminating, unset))
	slices.Sort(addrs)
	if err != nil || !slices.Equal(addrs, []string{"10.1.0.4:8443", "10.1.0.5:8443"}) {
		t.Fatalf("got %v, %v; want only the ready endpoints", addrs, err)
	}
}

func TestKubeNoEndpoints(t *testing.T) {
	_, _, err := resolveWebhook(t, KubeOptions{}, webhookService(intstr.FromInt32(8443)))
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("got %v, want Unavailable", err)
	}
	// A slice for another port of the Service does not serve this one.
	slice := endpointSlice("kcp-a", "webhook", "s1", "metrics", 9090, ready("10.1.0.1"))
	_, _, err = resolveWebhook(t, KubeOptions{}, webhookService(intstr.FromInt32(8443)), slice)
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("got %v, want Unavailable", err)
	}
}

// Several endpoints: every dial gets all of them, for the agent to fall back
// on, starting at a different one each time.
func TestKubeSeveralEndpointsSpreadLoad(t *testing.T) {
	k, first, err := resolveWebhook(t, KubeOptions{}, webhookService(intstr.FromInt32(8443)),
		webhookSlice("s1", 8443, ready("10.1.0.1"), ready("10.1.0.2")),
		webhookSlice("s2", 8443, ready("10.1.0.3"), ready("10.1.0.1"))) // a pod listed twice while slices move
	if err != nil {
		t.Fatal(err)
	}
	all := []string{"10.1.0.1:8443", "10.1.0.2:8443", "10.1.0.3:8443"}
	starts := map[string]bool{}
	for addrs := first; len(starts) < 3; addrs = mustResolve(t, k, target("c1", "default", "webhook", 443)) {
		sorted := slices.Sorted(slices.Values(addrs))
		if !slices.Equal(sorted, all) {
			t.Fatalf("got %v, want all of %v once", addrs, all)
		}
		if starts[addrs[0]] {
			t.Fatalf("dials started at %v twice before all were used (%v)", addrs[0], starts)
		}
		starts[addrs[0]] = true
	}
}

// An untrusted slice beside a managed one is ignored, not an error.
func TestKubeUnmanagedSliceIgnoredBesideManaged(t *testing.T) {
	rogue := webhookSlice("rogue", 8443, ready("10.9.9.9"))
	rogue.Labels[discoveryv1.LabelManagedBy] = "tenant"
	_, addrs, err := resolveWebhook(t, KubeOptions{}, webhookService(intstr.FromInt32(8443)), rogue, webhookSlice("s1", 8443, ready("10.1.0.1")))
	if err != nil || !slices.Equal(addrs, []string{"10.1.0.1:8443"}) {
		t.Fatalf("got %v, %v", addrs, err)
	}
}

func TestKubeRefusedEndpointAddresses(t *testing.T) {
	for _, ip := range []string{"127.0.0.1", "127.3.4.5", "::1", "::ffff:127.0.0.1", "169.254.169.254", "fe80::1",
		"0.0.0.0", "::", "224.0.0.1", "ff02::1", "255.255.255.255", "not-an-ip"} {
		t.Run(ip, func(t *testing.T) {
			slice := webhookSlice("s1", 8443, ready(ip))
			if strings.Contains(ip, ":") {
				slice.AddressType = discoveryv1.AddressTypeIPv6
			}
			_, addrs, err := resolveWebhook(t, KubeOptions{}, webhookService(intstr.FromInt32(8443)), slice)
			if status.Code(err) != codes.PermissionDenied {
				t.Fatalf("got %v, %v; want PermissionDenied", addrs, err)
			}
			t.Log(err)
		})
	}
	t.Run("FQDN", func(t *testing.T) {
		slice := webhookSlice("s1", 8443, ready("example.com"))
		slice.AddressType = discoveryv1.AddressTypeFQDN
		_, _, err := resolveWebhook(t, KubeOptions{}, webhookService(intstr.FromInt32(8443)), slice)
		if status.Code(err) != codes.PermissionDenied {
			t.Fatalf("got %v; want PermissionDenied", err)
		}
	})
	t.Run("mixed", func(t *testing.T) {
		_, addrs, err := resolveWebhook(t, KubeOptions{}, webhookService(intstr.FromInt32(8443)),
			webhookSlice("s1", 8443, ready("127.0.0.1"), ready("10.1.0.1"), ready("169.254.0.1")))
		if err != nil || !slices.Equal(addrs, []string{"10.1.0.1:8443"}) {
			t.Fatalf("got %v, %v; want only the permitted endpoint", addrs, err)
		}
	})
}
