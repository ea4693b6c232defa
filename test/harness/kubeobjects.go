package harness

import (
	"bufio"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"

	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
)

// What the KubeAPIServer and RealKCP tests write into a physical cluster's
// API as its controllers and kubelets would: no controller manager or
// kubelet runs beside the tests' kube-apiserver.

// AgentUser is the agent's identity towards the physical cluster: the
// ServiceAccount of deploy/agent/rbac.yaml, authenticated in tests by a
// client certificate with its user name (KubeCluster.Config), so it has
// exactly the rights that manifest grants.
const AgentUser = "system:serviceaccount:kcp-tunnel:kcp-tunnel-syncer-agent"

// ApplyAgentRBAC creates what deploy/agent/rbac.yaml holds, as shipped: the
// agent's ServiceAccount (AgentUser) and what it may read.
func ApplyAgentRBAC(t testing.TB, admin kubernetes.Interface) {
	t.Helper()
	rbacManifest := filepath.Join(RepoRoot(), "deploy", "agent", "rbac.yaml")
	ctx := context.Background()
	if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "kcp-tunnel"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(rbacManifest)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	docs := utilyaml.NewYAMLReader(bufio.NewReader(f))
	for {
		doc, err := docs.Read()
		if errors.Is(err, io.EOF) {
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		obj, _, err := scheme.Codecs.UniversalDeserializer().Decode(doc, nil, nil)
		if err != nil {
			t.Fatalf("%s: %v", rbacManifest, err)
		}
		switch o := obj.(type) {
		case *corev1.ServiceAccount:
			_, err = admin.CoreV1().ServiceAccounts(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		case *rbacv1.ClusterRole:
			_, err = admin.RbacV1().ClusterRoles().Create(ctx, o, metav1.CreateOptions{})
		case *rbacv1.ClusterRoleBinding:
			_, err = admin.RbacV1().ClusterRoleBindings().Create(ctx, o, metav1.CreateOptions{})
		default:
			t.Fatalf("%s: unexpected %T", rbacManifest, obj)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
}

// KubeService creates a Service with a selector (so the EndpointSlice
// controller would own its slices) and port 443 named "https" -> targetPort.
// The test's cleanup deletes it, which frees its cluster IP: the shared API
// server's service range would fill up over go test -count=N otherwise.
func KubeService(t testing.TB, admin kubernetes.Interface, ns, name string, targetPort intstr.IntOrString) *corev1.Service {
	t.Helper()
	services := admin.CoreV1().Services(ns)
	svc, err := services.Create(context.Background(), &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"app": name},
			Ports:    []corev1.ServicePort{{Name: "https", Port: 443, TargetPort: targetPort}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := services.Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("deleting Service %s/%s: %v", ns, name, err)
		}
	})
	return svc
}

// KubeEndpoint is one endpoint of an EndpointSlice.
type KubeEndpoint struct {
	IP    string
	Ready bool
}

// SetKubeEndpoints creates or replaces the EndpointSlice name of Service
// svc as the EndpointSlice controller writes it, after the Pods it lists:
// for each endpoint, a running Pod at its address that the Service
// selects; then a slice managed by the controller and controlled by the
// Service, whose endpoints name those Pods.
func SetKubeEndpoints(t testing.TB, admin kubernetes.Interface, ns, svc, name string, port int32, eps ...KubeEndpoint) {
	t.Helper()
	service, err := admin.CoreV1().Services(ns).Get(context.Background(), svc, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	slice := NewEndpointSlice(svc, name, lookup.EndpointSliceController, port, eps...)
	slice.OwnerReferences = []metav1.OwnerReference{*metav1.NewControllerRef(service, corev1.SchemeGroupVersion.WithKind("Service"))}
	for i, ep := range eps {
		pod := KubePod(t, admin, ns, service.Spec.Selector, ep.IP, false)
		slice.Endpoints[i].TargetRef = &corev1.ObjectReference{Kind: "Pod", Namespace: ns, Name: pod.Name, UID: pod.UID}
	}
	if err := WriteEndpointSlice(admin, ns, slice); err != nil {
		t.Fatal(err)
	}
}

// NewEndpointSlice is an IPv4 EndpointSlice of Service svc with one port named
// "https" and the given endpoints.
func NewEndpointSlice(svc, name, managedBy string, port int32, eps ...KubeEndpoint) *discoveryv1.EndpointSlice {
	portName, tcp := "https", corev1.ProtocolTCP
	slice := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{
			discoveryv1.LabelServiceName: svc,
			discoveryv1.LabelManagedBy:   managedBy,
		}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: &portName, Port: &port, Protocol: &tcp}},
	}
	for _, ep := range eps {
		ready := ep.Ready
		slice.Endpoints = append(slice.Endpoints, discoveryv1.Endpoint{
			Addresses:  []string{ep.IP},
			Conditions: discoveryv1.EndpointConditions{Ready: &ready, Serving: &ready},
		})
	}
	return slice
}

// WriteEndpointSlice creates slice in namespace ns, or replaces the one of its name.
func WriteEndpointSlice(admin kubernetes.Interface, ns string, slice *discoveryv1.EndpointSlice) error {
	ctx := context.Background()
	slices := admin.DiscoveryV1().EndpointSlices(ns)
	_, err := slices.Create(ctx, slice, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		var old *discoveryv1.EndpointSlice
		if old, err = slices.Get(ctx, slice.Name, metav1.GetOptions{}); err == nil {
			slice.ResourceVersion = old.ResourceVersion
			_, err = slices.Update(ctx, slice, metav1.UpdateOptions{})
		}
	}
	return err
}

// KubePod creates the Pod "pod-<ip>" of namespace ns with the given labels, or
// adds them to it, and writes its status as its kubelet would: running at
// ip, which is its node's address if hostNetwork. No kubelet runs here, so
// nothing else ever changes it.
func KubePod(t testing.TB, admin kubernetes.Interface, ns string, labels map[string]string, ip string, hostNetwork bool) *corev1.Pod {
	t.Helper()
	ctx := context.Background()
	pods := admin.CoreV1().Pods(ns)
	name := "pod-" + strings.ReplaceAll(ip, ".", "-")
	// Admission gives a Pod the namespace's default ServiceAccount, which
	// nothing creates here but this.
	if _, err := admin.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}},
		metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	p, err := pods.Get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		p, err = pods.Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels},
			Spec: corev1.PodSpec{
				HostNetwork:                  hostNetwork,
				AutomountServiceAccountToken: new(false),
				Containers:                   []corev1.Container{{Name: "server", Image: "example.com/server"}},
			},
		}, metav1.CreateOptions{})
	case err == nil && p.Spec.HostNetwork == hostNetwork:
		if p.Labels == nil {
			p.Labels = map[string]string{}
		}
		for k, v := range labels {
			p.Labels[k] = v
		}
		p, err = pods.Update(ctx, p, metav1.UpdateOptions{})
	case err == nil:
		t.Fatalf("Pod %s/%s exists, with hostNetwork %v", ns, name, p.Spec.HostNetwork)
	}
	if err != nil {
		t.Fatal(err)
	}
	p.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip, PodIPs: []corev1.PodIP{{IP: ip}}}
	if hostNetwork {
		p.Status.HostIP, p.Status.HostIPs = ip, []corev1.HostIP{{IP: ip}}
	}
	p, err = pods.UpdateStatus(ctx, p, metav1.UpdateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return p
}
