package realkcp

import (
	"context"
	"fmt"
	"testing"
	"time"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiextensionsclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// Two workspaces hold the same CRD, whose conversion webhook is the same
// Service name, each served by an agent of its own: kcp converts each
// workspace's objects with its own webhook, through the tunnel (the patch
// gives each logical cluster a converter factory of its own).
func TestRealKCPConversionWebhookPerWorkspace(t *testing.T) {
	s := kcp(t)
	ctx := context.Background()
	v1 := schema.GroupVersionResource{Group: harness.WidgetGroup, Version: "v1", Resource: "widgets"}
	v2 := schema.GroupVersionResource{Group: harness.WidgetGroup, Version: "v2", Resource: "widgets"}

	names := []string{"a", "b"}
	ws := map[string]*workspace{}
	for _, name := range names {
		w := s.workspace(t, name)
		ws[name] = w
		wh := harness.StartTLSWebhook(t, harness.WebhookOptions{Namespace: "webhooks", Name: "webhook", CA: s.ca}, harness.ConversionHandler(name))
		s.agent(t, name, w.cluster, wh.Addr)
		s.createCRD(t, w, harness.WidgetCRD(harness.WebhookService{Namespace: "webhooks", Name: "webhook", Path: "/convert", Port: 443, CABundle: wh.CABundle}))
		// Stored as v1, with no conversion.
		eventually(t, "a Widget created in "+w.path, func() (bool, string) {
			_, err := w.dyn.Resource(v1).Namespace(namespace).Create(ctx, harness.Widget(namespace, "w", "3"), metav1.CreateOptions{})
			return err == nil, errText(err)
		})
	}

	// Read as v2: each workspace's webhook converts its own Widget.
	for _, name := range names {
		w := ws[name]
		got := eventually(t, "a Widget of "+w.path+" read as v2", func() (bool, string) {
			obj, err := w.dyn.Resource(v2).Namespace(namespace).Get(ctx, "w", metav1.GetOptions{})
			if err != nil {
				return false, errText(err)
			}
			replicas, _, _ := unstructured.NestedInt64(obj.Object, "spec", "replicas")
			by := obj.GetLabels()["converted-by"]
			return replicas == 3 && by != "", fmt.Sprintf("spec.replicas %d, converted by %q", replicas, by)
		})
		if want := "spec.replicas 3, converted by " + fmt.Sprintf("%q", name); got != want {
			t.Errorf("%s: the Widget read as v2 has %s, want %s", w.path, got, want)
		}
		s.assertKCPTunnels(t, w.cluster, name)
	}
}

// createCRD creates crd in w and waits until it is established.
func (s *server) createCRD(t *testing.T, w *workspace, crd *apiextensionsv1.CustomResourceDefinition) {
	t.Helper()
	ctx := context.Background()
	crds := apiextensionsclient.NewForConfigOrDie(s.config(w.path)).ApiextensionsV1().CustomResourceDefinitions()
	if _, err := crds.Create(ctx, crd, metav1.CreateOptions{}); err != nil {
		t.Fatalf("creating the CRD in %s: %v", w.path, err)
	}
	harness.Eventually(t, time.Minute, "the CRD to be established in "+w.path, func() bool {
		got, err := crds.Get(ctx, crd.Name, metav1.GetOptions{})
		if err != nil {
			return false
		}
		for _, c := range got.Status.Conditions {
			if c.Type == apiextensionsv1.Established && c.Status == apiextensionsv1.ConditionTrue {
				return true
			}
		}
		return false
	})
}
