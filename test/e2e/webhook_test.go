package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kcp-dev/tunnel-broker/internal/devca"
	"github.com/kcp-dev/tunnel-broker/kcpplugin"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

const cluster = "root"

// review allows ConfigMaps unless they ask to be denied, and labels them
// with the caller's client certificate CN when a patch is wanted.
func review(req *admissionv1.AdmissionRequest, clientCN string) *admissionv1.AdmissionResponse {
	raw := string(req.Object.Raw)
	if strings.Contains(raw, `"deny":"yes"`) {
		return &admissionv1.AdmissionResponse{Allowed: false, Result: &metav1.Status{Message: "denied through the tunnel", Code: 403}}
	}
	resp := &admissionv1.AdmissionResponse{Allowed: true}
	if strings.Contains(raw, `"patch":"yes"`) {
		pt := admissionv1.PatchTypeJSONPatch
		resp.PatchType = &pt
		resp.Patch = []byte(`[{"op":"add","path":"/metadata/labels","value":{"tunneled":"yes","client":"` + clientCN + `"}}]`)
	}
	return resp
}

// tunnelFor starts a broker, a webhook server for default/webhook and an
// agent serving it in cluster "root"; it returns kcp's dialer and the
// webhook's Service.
func tunnelFor(t *testing.T, env *harness.Env, wh *harness.Webhook) (*kcpplugin.Dialer, harness.WebhookService) {
	b := env.StartBroker(harness.BrokerOptions{})
	env.StartAgent(b.Addr, "/agent/sync-target-1", lookup.StaticFile{Services: []lookup.StaticService{{
		Cluster: cluster, Namespace: "default", Name: "webhook", Ports: map[string]string{"443": wh.Addr},
	}}})
	return env.Dialer(b.Addr, "/kcp"), harness.WebhookService{
		Namespace: "default", Name: "webhook", Path: "/admit", Port: 443, CABundle: wh.CABundle,
	}
}

func configMap(data map[string]string) *corev1.ConfigMap {
	return &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "cm"}, Data: data}
}

func TestWebhookValidatingAllowsAndDenies(t *testing.T) {
	env := harness.NewEnv(t)
	wh := harness.StartWebhook(t, harness.WebhookOptions{Namespace: "default", Name: "webhook"}, review)
	dialer, svc := tunnelFor(t, env, wh)
	adm := harness.NewAdmission(t, harness.AdmissionOptions{Service: svc, Wrapper: kcpplugin.AuthInfoResolverWrapper(cluster, dialer)})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	if _, err := adm.Admit(ctx, configMap(nil)); err != nil {
		t.Fatalf("allowed request: %v", err)
	}
	_, err := adm.Admit(ctx, configMap(map[string]string{"deny": "yes"}))
	if err == nil || !strings.Contains(err.Error(), "denied through the tunnel") {
		t.Fatalf("denied request: got %v, want the webhook's denial", err)
	}
}

func TestWebhookMutatingPatchesWithKcpClientCertificate(t *testing.T) {
	env := harness.NewEnv(t)
	kcpCA, err := devca.New("kcp client CA", "")
	if err != nil {
		t.Fatal(err)
	}
	kcpCert, err := kcpCA.Issue(devca.Leaf{CommonName: "kcp-webhook-client"})
	if err != nil {
		t.Fatal(err)
	}
	wh := harness.StartWebhook(t, harness.WebhookOptions{Namespace: "default", Name: "webhook", ClientCA: kcpCA}, review)
	dialer, svc := tunnelFor(t, env, wh)
	adm := harness.NewAdmission(t, harness.AdmissionOptions{
		Mutating: true, Service: svc, ClientCert: kcpCert,
		Wrapper: kcpplugin.AuthInfoResolverWrapper(cluster, dialer),
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	got, err := adm.Admit(ctx, configMap(map[string]string{"patch": "yes"}))
	if err != nil {
		t.Fatalf("mutating request: %v", err)
	}
	if got.Labels["tunneled"] != "yes" {
		t.Errorf("labels = %v, want the webhook's patch", got.Labels)
	}
	// The webhook saw kcp's own client certificate: TLS ran end to end.
	if got.Labels["client"] != "kcp-webhook-client" {
		t.Errorf("webhook saw client certificate %q, want kcp's", got.Labels["client"])
	}
}

func TestWebhookWithoutClientCertificateIsRefusedByWebhook(t *testing.T) {
	env := harness.NewEnv(t)
	kcpCA, err := devca.New("kcp client CA", "")
	if err != nil {
		t.Fatal(err)
	}
	wh := harness.StartWebhook(t, harness.WebhookOptions{Namespace: "default", Name: "webhook", ClientCA: kcpCA}, review)
	dialer, svc := tunnelFor(t, env, wh)
	adm := harness.NewAdmission(t, harness.AdmissionOptions{Service: svc, Wrapper: kcpplugin.AuthInfoResolverWrapper(cluster, dialer)})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	if _, err := adm.Admit(ctx, configMap(nil)); err == nil {
		t.Fatal("a webhook that requires a client certificate admitted a caller without one")
	}
}

func TestWebhookWrongCABundleFailsTLS(t *testing.T) {
	env := harness.NewEnv(t)
	wh := harness.StartWebhook(t, harness.WebhookOptions{Namespace: "default", Name: "webhook"}, review)
	dialer, svc := tunnelFor(t, env, wh)
	other, err := devca.New("some other CA", "")
	if err != nil {
		t.Fatal(err)
	}
	svc.CABundle = other.BundlePEM()
	adm := harness.NewAdmission(t, harness.AdmissionOptions{Service: svc, Wrapper: kcpplugin.AuthInfoResolverWrapper(cluster, dialer)})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	_, err = adm.Admit(ctx, configMap(nil))
	if err == nil || !strings.Contains(err.Error(), "x509") {
		t.Fatalf("got %v, want a certificate verification failure", err)
	}
}

func TestWebhookServerNameIsServiceDNSName(t *testing.T) {
	env := harness.NewEnv(t)
	// The server's certificate names webhook.default.svc; a configuration
	// that points at another Service name of the same server must fail
	// verification, although the bytes reach the same listener.
	wh := harness.StartWebhook(t, harness.WebhookOptions{Namespace: "default", Name: "webhook"}, review)
	b := env.StartBroker(harness.BrokerOptions{})
	env.StartAgent(b.Addr, "/agent/sync-target-1", lookup.StaticFile{Services: []lookup.StaticService{{
		Cluster: cluster, Namespace: "default", Name: "impostor", Ports: map[string]string{"443": wh.Addr},
	}}})
	svc := harness.WebhookService{Namespace: "default", Name: "impostor", Path: "/admit", Port: 443, CABundle: wh.CABundle}
	adm := harness.NewAdmission(t, harness.AdmissionOptions{Service: svc, Wrapper: kcpplugin.AuthInfoResolverWrapper(cluster, env.Dialer(b.Addr, "/kcp"))})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	_, err := adm.Admit(ctx, configMap(nil))
	if err == nil || !strings.Contains(err.Error(), "impostor.default.svc") {
		t.Fatalf("got %v, want a certificate name mismatch for impostor.default.svc", err)
	}
}
