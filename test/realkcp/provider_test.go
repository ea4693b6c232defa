package realkcp

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/kcp-dev/tunnel-broker/test/harness"
)

var widgets = schema.GroupVersionResource{Group: "example.io", Version: "v1", Resource: "widgets"}

// The provider's case: an APIExport whose workspace holds the webhook
// configuration for its resource, bound in a consumer's workspace. Creating
// the bound resource in the consumer's workspace calls the provider's
// webhook through the agent that serves the export's logical cluster from
// the provider's service cluster, a real kube-apiserver. No agent serves the consumer's cluster, so a
// plugin that dialed for the request's cluster instead would fail.
func TestRealKCPProviderWebhookForABoundResource(t *testing.T) {
	s := kcp(t)
	ctx := context.Background()
	provider, consumer := s.workspace(t, "provider"), s.workspace(t, "consumer")
	// The provider's service cluster: its webhook pod at podIP behind
	// Service webhooks/webhook, and an agent in plain mode serving the
	// export's logical cluster from that cluster's API.
	const podIP, podPort = "192.0.2.30", 8443
	wh := s.startStandIn(t, "provider", net.JoinHostPort(podIP, strconv.Itoa(podPort)))
	if _, err := s.admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "webhooks"}},
		metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	harness.KubeService(t, s.admin, "webhooks", "webhook", intstr.FromInt32(podPort))
	harness.SetKubeEndpoints(t, s.admin, "webhooks", "webhook", "webhook-abcde", podPort, harness.KubeEndpoint{IP: podIP, Ready: true})
	s.plainAgent(t, "provider", provider.cluster)

	create := func(w *workspace, gvr schema.GroupVersionResource, obj map[string]any) {
		t.Helper()
		if _, err := w.dyn.Resource(gvr).Create(ctx, &unstructured.Unstructured{Object: obj}, metav1.CreateOptions{}); err != nil {
			t.Fatalf("creating %s in %s: %v", gvr.Resource, w.path, err)
		}
	}
	create(provider, schemas, map[string]any{
		"apiVersion": "apis.kcp.io/v1alpha1", "kind": "APIResourceSchema",
		"metadata": map[string]any{"name": "v1.widgets.example.io"},
		"spec": map[string]any{
			"group": "example.io",
			"names": map[string]any{"kind": "Widget", "listKind": "WidgetList", "plural": "widgets", "singular": "widget"},
			"scope": "Namespaced",
			"versions": []any{map[string]any{
				"name": "v1", "served": true, "storage": true,
				"schema": map[string]any{"type": "object", "x-kubernetes-preserve-unknown-fields": true},
			}},
		},
	})
	create(provider, exports, map[string]any{
		"apiVersion": "apis.kcp.io/v1alpha1", "kind": "APIExport",
		"metadata": map[string]any{"name": "widgets"},
		"spec":     map[string]any{"latestResourceSchemas": []any{"v1.widgets.example.io"}},
	})
	provider.validating(t, wh.CABundle, admissionregistrationv1.Fail, "example.io", "widgets")

	// kcp checks the right to bind against its authorization caches, which
	// may not have the new export's workspace yet: "no permission to bind"
	// until they have.
	eventually(t, "kcp to let the consumer bind the export", func() (bool, string) {
		_, err := consumer.dyn.Resource(bindings).Create(ctx, &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": "apis.kcp.io/v1alpha1", "kind": "APIBinding",
			"metadata": map[string]any{"name": "widgets"},
			"spec": map[string]any{"reference": map[string]any{"export": map[string]any{
				"path": provider.path, "name": "widgets",
			}}},
		}}, metav1.CreateOptions{})
		if err != nil && !strings.Contains(err.Error(), "no permission to bind") {
			t.Fatalf("creating apibindings in %s: %v", consumer.path, err)
		}
		return err == nil, errText(err)
	})
	harness.Eventually(t, 2*time.Minute, "the consumer's APIBinding to be bound", func() bool {
		b, err := consumer.dyn.Resource(bindings).Get(ctx, "widgets", metav1.GetOptions{})
		if err != nil {
			return false
		}
		phase, _, _ := unstructured.NestedString(b.Object, "status", "phase")
		return phase == "Bound"
	})

	widget := func(name string, deny bool) error {
		labels := map[string]any{"test": "realkcp"}
		if deny {
			labels["deny"] = "yes"
		}
		_, err := consumer.dyn.Resource(widgets).Namespace(namespace).Create(ctx, &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": "example.io/v1", "kind": "Widget",
			"metadata": map[string]any{"name": name, "labels": labels},
		}}, metav1.CreateOptions{})
		return err
	}
	n := 0
	msg := eventually(t, "the provider's webhook to refuse a Widget in the consumer's workspace", func() (bool, string) {
		n++
		msg := errText(widget(fmt.Sprintf("probe-%d", n), true))
		return strings.Contains(msg, "denied by webhook provider"), msg
	})
	t.Logf("kcp refused: %s", msg)
	if err := widget("allowed", false); err != nil {
		t.Fatalf("a Widget the provider's webhook allows: %v", err)
	}
	// The webhook reviewed the consumer's object (kcp annotates it with its
	// cluster), called for the provider's cluster.
	if !wh.saw(consumer.cluster, "allowed") {
		t.Errorf("the provider's webhook did not review Widget allowed of the consumer's cluster %s: it reviewed %v", consumer.cluster, wh.reviewed)
	}
	// The broker's side: kcp dialed the provider's cluster, never the
	// consumer's.
	s.assertKCPTunnels(t, provider.cluster, "provider")
	if got := s.tunnels(t, consumer.cluster); len(got) != 0 {
		t.Errorf("the broker holds %d tunnels to the consumer's cluster %s, which no webhook is of", len(got), consumer.cluster)
	}
}
