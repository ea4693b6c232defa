package webhook

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"os"
	"strings"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apiserver/pkg/admission"
	"k8s.io/apiserver/pkg/admission/plugin/webhook/validating"
	"k8s.io/apiserver/pkg/authentication/user"
	webhookutil "k8s.io/apiserver/pkg/util/webhook"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/kubernetes/scheme"
)

// The release check runs a broker, an agent serving logical cluster "root"
// and a TLS webhook behind Service default/webhook, and tells this test
// where they are.
func env(t *testing.T, name string) string {
	v := os.Getenv(name)
	if v == "" {
		t.Skipf("$%s is not set: the release check (make release-check) runs this test", name)
	}
	return v
}

func TestAdmissionWebhookThroughTheTunnel(t *testing.T) {
	broker := env(t, "TUNNEL_BROKER")
	cert, err := tls.LoadX509KeyPair(env(t, "TUNNEL_SVID_CERT"), env(t, "TUNNEL_SVID_KEY"))
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	bundle, err := os.ReadFile(env(t, "TUNNEL_TRUST_BUNDLE"))
	if err != nil || !roots.AppendCertsFromPEM(bundle) {
		t.Fatalf("trust bundle: %v", err)
	}
	caBundle, err := os.ReadFile(env(t, "TUNNEL_WEBHOOK_CA"))
	if err != nil {
		t.Fatal(err)
	}
	tunnel, err := Connect(broker, &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: roots, MinVersion: tls.VersionTLS12})
	if err != nil {
		t.Fatal(err)
	}
	defer tunnel.Close()

	plugin := validatingPlugin(t, tunnel.WrapperFor("root"), caBundle)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := admit(ctx, plugin, nil); err != nil {
		t.Fatalf("an allowed ConfigMap: %v", err)
	}
	if err := admit(ctx, plugin, map[string]string{"deny": "yes"}); err == nil || !strings.Contains(err.Error(), "denied through the tunnel") {
		t.Fatalf("a denied ConfigMap: got %v, want the webhook's denial", err)
	}
}

// validatingPlugin is k8s.io/apiserver's validating webhook plugin with one
// configuration whose webhook is Service default/webhook port 443, set up
// as kcp sets up a logical cluster's plugin: the tunnel's wrapper last.
func validatingPlugin(t *testing.T, wrapper webhookutil.AuthenticationInfoResolverWrapper, caBundle []byte) admission.ValidationInterface {
	t.Helper()
	fail, none, timeout := admissionregistrationv1.Fail, admissionregistrationv1.SideEffectClassNone, int32(10)
	port, path := int32(443), "/admit"
	client := fake.NewClientset(
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "default"}},
		&admissionregistrationv1.ValidatingWebhookConfiguration{
			ObjectMeta: metav1.ObjectMeta{Name: "tunneled"},
			Webhooks: []admissionregistrationv1.ValidatingWebhook{{
				Name: "validate.tunnel.test",
				ClientConfig: admissionregistrationv1.WebhookClientConfig{
					Service:  &admissionregistrationv1.ServiceReference{Namespace: "default", Name: "webhook", Path: &path, Port: &port},
					CABundle: caBundle,
				},
				Rules: []admissionregistrationv1.RuleWithOperations{{
					Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create},
					Rule:       admissionregistrationv1.Rule{APIGroups: []string{""}, APIVersions: []string{"v1"}, Resources: []string{"configmaps"}},
				}},
				FailurePolicy: &fail, SideEffects: &none, TimeoutSeconds: &timeout,
				AdmissionReviewVersions: []string{"v1"},
				NamespaceSelector:       &metav1.LabelSelector{}, ObjectSelector: &metav1.LabelSelector{},
			}},
		})
	factory := informers.NewSharedInformerFactory(client, 0)
	plugin, err := validating.NewValidatingAdmissionWebhook(nil)
	if err != nil {
		t.Fatal(err)
	}
	plugin.SetExternalKubeClientSet(client)
	plugin.SetExternalKubeInformerFactory(factory)
	plugin.SetAuthenticationInfoResolverWrapper(wrapper)
	if err := plugin.ValidateInitialization(); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop); factory.Shutdown() })
	factory.Start(stop)
	factory.WaitForCacheSync(stop)
	return plugin
}

func admit(ctx context.Context, plugin admission.ValidationInterface, data map[string]string) error {
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "cm"}, Data: data}
	attrs := admission.NewAttributesRecord(cm, nil, corev1.SchemeGroupVersion.WithKind("ConfigMap"),
		cm.Namespace, cm.Name, corev1.SchemeGroupVersion.WithResource("configmaps"), "",
		admission.Create, &metav1.CreateOptions{}, false, &user.DefaultInfo{Name: "alice"})
	o := admission.NewObjectInterfacesFromScheme(scheme.Scheme)
	// The plugin's webhook source syncs after its informer does.
	for {
		err := plugin.Validate(ctx, attrs, o)
		if err == nil || !strings.Contains(err.Error(), "not yet ready") || ctx.Err() != nil {
			return err
		}
		time.Sleep(20 * time.Millisecond)
	}
}
