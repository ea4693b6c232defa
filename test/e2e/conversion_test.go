package e2e

import (
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/kcp-dev/tunnel-broker/internal/devca"
	"github.com/kcp-dev/tunnel-broker/kcpplugin"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// CRD conversion webhooks reach their Service the way admission webhooks
// do: k8s.io/apiextensions-apiserver's webhook converter takes the same
// AuthenticationInfoResolverWrapper, and kcpplugin's carries its calls
// through the broker and the agent to a TLS conversion webhook.

var widgetV2 = schema.GroupVersion{Group: harness.WidgetGroup, Version: "v2"}

// conversionService is Service default/convert, port 443, path /convert.
func conversionService(wh *harness.Webhook) harness.WebhookService {
	return harness.WebhookService{Namespace: "default", Name: "convert", Path: "/convert", Port: 443, CABundle: wh.CABundle}
}

// startConversionTunnel starts a conversion webhook for Service
// default/convert, a broker, and an agent that serves it in cluster root.
func startConversionTunnel(t *testing.T, env *harness.Env) (*harness.Webhook, *kcpplugin.Dialer) {
	wh := harness.StartTLSWebhook(t, harness.WebhookOptions{Namespace: "default", Name: "convert"}, harness.ConversionHandler("root-webhook"))
	b := env.StartBroker(harness.BrokerOptions{})
	env.StartAgent(b.Addr, "/agent/sync-target-1", lookup.StaticFile{Services: []lookup.StaticService{{
		Cluster: cluster, Namespace: "default", Name: "convert", Ports: map[string]string{"443": wh.Addr},
	}}})
	return wh, env.Dialer(b.Addr, "/kcp")
}

func TestConversionWebhookConvertsThroughTheTunnel(t *testing.T) {
	env := harness.NewEnv(t)
	wh, dialer := startConversionTunnel(t, env)
	converter := harness.CRDConverter(t, harness.WidgetCRD(conversionService(wh)), kcpplugin.AuthInfoResolverWrapper(cluster, dialer))

	out, err := converter.ConvertToVersion(harness.Widget("default", "w", "3"), widgetV2)
	if err != nil {
		t.Fatalf("converting a Widget to v2: %v", err)
	}
	got := out.(*unstructured.Unstructured)
	replicas, _, _ := unstructured.NestedInt64(got.Object, "spec", "replicas")
	if got.GetAPIVersion() != widgetV2.String() || replicas != 3 || got.GetLabels()["converted-by"] != "root-webhook" {
		t.Fatalf("converted Widget: %v, want v2 with spec.replicas 3, converted by root-webhook", got.Object)
	}

	// A list is one ConversionReview with every item: one call, one tunnel.
	list := &unstructured.UnstructuredList{Object: map[string]any{"apiVersion": harness.WidgetGroup + "/v1", "kind": "WidgetList"}}
	for _, size := range []string{"1", "2", "5"} {
		list.Items = append(list.Items, *harness.Widget("default", "w"+size, size))
	}
	out, err = converter.ConvertToVersion(list, widgetV2)
	if err != nil {
		t.Fatalf("converting a WidgetList to v2: %v", err)
	}
	for i, item := range out.(*unstructured.UnstructuredList).Items {
		n, _, _ := unstructured.NestedInt64(item.Object, "spec", "replicas")
		if item.GetAPIVersion() != widgetV2.String() || n != []int64{1, 2, 5}[i] {
			t.Errorf("item %d: %v", i, item.Object)
		}
	}
}

func TestConversionFailsWithUnavailableWhenTheAgentIsGone(t *testing.T) {
	env := harness.NewEnv(t)
	wh := harness.StartTLSWebhook(t, harness.WebhookOptions{Namespace: "default", Name: "convert"}, harness.ConversionHandler("root-webhook"))
	_, addr := env.StartBrokerProcess()
	agent := env.StartAgentProcess(addr, "/agent/sync-target-1", lookup.StaticFile{Services: []lookup.StaticService{{
		Cluster: cluster, Namespace: "default", Name: "convert", Ports: map[string]string{"443": wh.Addr},
	}}})
	converter := harness.CRDConverter(t, harness.WidgetCRD(conversionService(wh)), kcpplugin.AuthInfoResolverWrapper(cluster, env.Dialer(addr, "/kcp")))
	if _, err := converter.ConvertToVersion(harness.Widget("default", "w", "3"), widgetV2); err != nil {
		t.Fatalf("with the agent up: %v", err)
	}

	// The agent dies: its tunnels, and the webhook client's kept-alive
	// connection in one of them, end with it.
	agent.Kill()
	_, err := converter.ConvertToVersion(harness.Widget("default", "w", "4"), widgetV2)
	if err == nil || !strings.Contains(err.Error(), codes.Unavailable.String()) || !strings.Contains(err.Error(), "conversion webhook") {
		t.Fatalf("with the agent gone: got %v, want the conversion webhook to fail with Unavailable", err)
	}
}

func TestConversionWithAWrongCABundleFailsTLS(t *testing.T) {
	env := harness.NewEnv(t)
	wh, dialer := startConversionTunnel(t, env)
	other, err := devca.New("some other CA", "")
	if err != nil {
		t.Fatal(err)
	}
	svc := conversionService(wh)
	svc.CABundle = other.BundlePEM()
	converter := harness.CRDConverter(t, harness.WidgetCRD(svc), kcpplugin.AuthInfoResolverWrapper(cluster, dialer))

	_, err = converter.ConvertToVersion(harness.Widget("default", "w", "3"), widgetV2)
	if err == nil || !strings.Contains(err.Error(), "x509") {
		t.Fatalf("got %v, want a certificate verification failure", err)
	}
}

// kcp holds CRDs of the same name, with conversion webhooks behind Services
// of the same name, in many logical clusters. The webhook client caches
// REST clients by the CRD's name and the Service, not by cluster, so kcp
// builds one converter factory per logical cluster, each with the wrapper
// bound to that cluster: each cluster's CRD then reaches its own webhook.
func TestConversionFactoriesPerClusterReachEachClustersOwnWebhook(t *testing.T) {
	env := harness.NewEnv(t)
	const other = "2x3y4z5w6v7u8t9s"
	whRoot := harness.StartTLSWebhook(t, harness.WebhookOptions{Namespace: "default", Name: "convert"}, harness.ConversionHandler("root-webhook"))
	whOther := harness.StartTLSWebhook(t, harness.WebhookOptions{Namespace: "default", Name: "convert"}, harness.ConversionHandler("other-webhook"))
	b := env.StartBroker(harness.BrokerOptions{})
	env.StartAgent(b.Addr, "/agent/sync-target-1", lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: cluster, Namespace: "default", Name: "convert", Ports: map[string]string{"443": whRoot.Addr}},
		{Cluster: other, Namespace: "default", Name: "convert", Ports: map[string]string{"443": whOther.Addr}},
	}})
	dialer := env.Dialer(b.Addr, "/kcp")

	for _, c := range []struct {
		cluster string
		wh      *harness.Webhook
		want    string
	}{{cluster, whRoot, "root-webhook"}, {other, whOther, "other-webhook"}} {
		converter := harness.CRDConverter(t, harness.WidgetCRD(conversionService(c.wh)), kcpplugin.AuthInfoResolverWrapper(c.cluster, dialer))
		out, err := converter.ConvertToVersion(harness.Widget("default", "w", "3"), widgetV2)
		if err != nil {
			t.Fatalf("cluster %s: %v", c.cluster, err)
		}
		if by := out.(runtime.Object).(*unstructured.Unstructured).GetLabels()["converted-by"]; by != c.want {
			t.Errorf("cluster %s: converted by %q, want %q", c.cluster, by, c.want)
		}
	}
}
