package harness

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/conversion"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	webhookutil "k8s.io/apiserver/pkg/util/webhook"
)

// WidgetGroup is the API group of the Widget CRD: v1 has spec.size, a
// string; v2 has spec.replicas, a number; converting takes a webhook.
const WidgetGroup = "stable.tunnel.test"

// WidgetCRD is a CRD with versions v1 (stored) and v2 whose conversion
// webhook is the Service s.
func WidgetCRD(s WebhookService) *apiextensionsv1.CustomResourceDefinition {
	schema := &apiextensionsv1.CustomResourceValidation{OpenAPIV3Schema: &apiextensionsv1.JSONSchemaProps{
		Type: "object", XPreserveUnknownFields: ptr(true),
	}}
	return &apiextensionsv1.CustomResourceDefinition{
		ObjectMeta: metav1.ObjectMeta{Name: "widgets." + WidgetGroup},
		Spec: apiextensionsv1.CustomResourceDefinitionSpec{
			Group: WidgetGroup,
			Names: apiextensionsv1.CustomResourceDefinitionNames{Plural: "widgets", Singular: "widget", Kind: "Widget", ListKind: "WidgetList"},
			Scope: apiextensionsv1.NamespaceScoped,
			Versions: []apiextensionsv1.CustomResourceDefinitionVersion{
				{Name: "v1", Served: true, Storage: true, Schema: schema},
				{Name: "v2", Served: true, Schema: schema},
			},
			Conversion: &apiextensionsv1.CustomResourceConversion{
				Strategy: apiextensionsv1.WebhookConverter,
				Webhook: &apiextensionsv1.WebhookConversion{
					ConversionReviewVersions: []string{"v1"},
					ClientConfig: &apiextensionsv1.WebhookClientConfig{
						Service:  &apiextensionsv1.ServiceReference{Namespace: s.Namespace, Name: s.Name, Path: &s.Path, Port: &s.Port},
						CABundle: s.CABundle,
					},
				},
			},
		},
	}
}

// Widget is a Widget object in v1 of the CRD.
func Widget(namespace, name, size string) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": WidgetGroup + "/v1", "kind": "Widget",
		"metadata": map[string]any{"namespace": namespace, "name": name},
		"spec":     map[string]any{"size": size},
	}}
}

// CRDConverter is k8s.io/apiextensions-apiserver's converter for crd, built
// as kcp builds the converters of one logical cluster: from a factory whose
// AuthenticationInfoResolverWrapper is wrapper.
func CRDConverter(t T, crd *apiextensionsv1.CustomResourceDefinition, wrapper webhookutil.AuthenticationInfoResolverWrapper) runtime.ObjectConvertor {
	t.Helper()
	factory, err := conversion.NewCRConverterFactory(webhookutil.NewDefaultServiceResolver(), wrapper)
	if err != nil {
		t.Fatal(err)
	}
	safe, _, err := factory.NewConverter(crd)
	if err != nil {
		t.Fatal(err)
	}
	return safe
}

// ConversionHandler answers ConversionReviews for Widgets between v1 and
// v2, and labels every object it converts converted-by=name, so that a test
// can tell which webhook converted it.
func ConversionHandler(name string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var review apiextensionsv1.ConversionReview
		if err := json.NewDecoder(r.Body).Decode(&review); err != nil || review.Request == nil {
			http.Error(w, "not a ConversionReview", http.StatusBadRequest)
			return
		}
		resp := &apiextensionsv1.ConversionResponse{UID: review.Request.UID, Result: metav1.Status{Status: metav1.StatusSuccess}}
		for _, raw := range review.Request.Objects {
			obj := &unstructured.Unstructured{}
			err := obj.UnmarshalJSON(raw.Raw)
			if err == nil {
				err = convertWidget(obj, review.Request.DesiredAPIVersion)
			}
			if err != nil {
				resp.ConvertedObjects = nil
				resp.Result = metav1.Status{Status: metav1.StatusFailure, Message: err.Error()}
				break
			}
			labels := obj.GetLabels()
			if labels == nil {
				labels = map[string]string{}
			}
			labels["converted-by"] = name
			obj.SetLabels(labels)
			resp.ConvertedObjects = append(resp.ConvertedObjects, runtime.RawExtension{Object: obj})
		}
		review.Request, review.Response = nil, resp
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(&review)
	})
}

func convertWidget(obj *unstructured.Unstructured, to string) error {
	from := obj.GetAPIVersion()
	switch {
	case from == to:
	case from == WidgetGroup+"/v1" && to == WidgetGroup+"/v2":
		size, _, _ := unstructured.NestedString(obj.Object, "spec", "size")
		n, err := strconv.ParseInt(size, 10, 64)
		if err != nil {
			return fmt.Errorf("spec.size %q is not a number", size)
		}
		unstructured.RemoveNestedField(obj.Object, "spec", "size")
		if err := unstructured.SetNestedField(obj.Object, n, "spec", "replicas"); err != nil {
			return err
		}
	case from == WidgetGroup+"/v2" && to == WidgetGroup+"/v1":
		n, _, _ := unstructured.NestedInt64(obj.Object, "spec", "replicas")
		unstructured.RemoveNestedField(obj.Object, "spec", "replicas")
		if err := unstructured.SetNestedField(obj.Object, strconv.FormatInt(n, 10), "spec", "size"); err != nil {
			return err
		}
	default:
		return fmt.Errorf("cannot convert %s to %s", from, to)
	}
	obj.SetAPIVersion(to)
	return nil
}

func ptr[V any](v V) *V { return &v }
