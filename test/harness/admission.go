package harness

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apiserver/pkg/admission"
	"k8s.io/apiserver/pkg/admission/plugin/webhook/mutating"
	"k8s.io/apiserver/pkg/admission/plugin/webhook/validating"
	"k8s.io/apiserver/pkg/authentication/user"
	webhookutil "k8s.io/apiserver/pkg/util/webhook"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/kubernetes/scheme"

	"github.com/kcp-dev/tunnel-broker/internal/devca"
)

// WebhookService is where a webhook configuration points: a Service port.
type WebhookService struct {
	Namespace, Name, Path string
	Port                  int32
	CABundle              []byte
}

// ClientConfig is the webhook configuration's clientConfig for s.
func (s WebhookService) ClientConfig() admissionregistrationv1.WebhookClientConfig {
	return admissionregistrationv1.WebhookClientConfig{
		Service:  &admissionregistrationv1.ServiceReference{Namespace: s.Namespace, Name: s.Name, Path: &s.Path, Port: &s.Port},
		CABundle: s.CABundle,
	}
}

// Admission is k8s.io/apiserver's real webhook admission plugin, validating
// or mutating, fed from a fake clientset that holds one webhook configuration.
type Admission struct {
	validate admission.ValidationInterface
	mutate   admission.MutationInterface
}

// AdmissionOptions choose the plugin and how kcp would set it up.
type AdmissionOptions struct {
	Mutating bool
	Service  WebhookService
	// Wrapper is applied last, as kcp applies kcpplugin's.
	Wrapper webhookutil.AuthenticationInfoResolverWrapper
	// ClientCert, if set, is the certificate kcp's webhook client presents,
	// given through the admission config's kubeconfig as in a real server.
	ClientCert *devca.Issued
}

// NewAdmission builds and starts the plugin; it stops with the test.
func NewAdmission(t T, opts AdmissionOptions) *Admission {
	t.Helper()
	client := fake.NewSimpleClientset(webhookObjects(opts)...)
	factory := informers.NewSharedInformerFactory(client, 0)

	config := admissionConfig(t, opts.ClientCert)
	a := &Admission{}
	var init interface {
		SetAuthenticationInfoResolverWrapper(webhookutil.AuthenticationInfoResolverWrapper)
		ValidateInitialization() error
	}
	if opts.Mutating {
		p, err := mutating.NewMutatingWebhook(config)
		if err != nil {
			t.Fatal(err)
		}
		p.SetExternalKubeClientSet(client)
		p.SetExternalKubeInformerFactory(factory)
		a.mutate, init = p, p
	} else {
		p, err := validating.NewValidatingAdmissionWebhook(config)
		if err != nil {
			t.Fatal(err)
		}
		p.SetExternalKubeClientSet(client)
		p.SetExternalKubeInformerFactory(factory)
		a.validate, init = p, p
	}
	if opts.Wrapper != nil {
		init.SetAuthenticationInfoResolverWrapper(opts.Wrapper)
	}
	if err := init.ValidateInitialization(); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop); factory.Shutdown() })
	factory.Start(stop)
	factory.WaitForCacheSync(stop)
	return a
}

// webhookObjects is what the fake clientset holds: the default namespace
// and one webhook configuration, mutating or validating as opts say, that
// sends every ConfigMap creation to opts.Service and fails closed.
func webhookObjects(opts AdmissionOptions) []runtime.Object {
	fail := admissionregistrationv1.Fail
	none := admissionregistrationv1.SideEffectClassNone
	timeout := int32(10)
	rules := []admissionregistrationv1.RuleWithOperations{{
		Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create},
		Rule:       admissionregistrationv1.Rule{APIGroups: []string{""}, APIVersions: []string{"v1"}, Resources: []string{"configmaps"}},
	}}
	objects := []runtime.Object{&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "default"}}}
	if opts.Mutating {
		return append(objects, &admissionregistrationv1.MutatingWebhookConfiguration{
			ObjectMeta: metav1.ObjectMeta{Name: "tunneled"},
			Webhooks: []admissionregistrationv1.MutatingWebhook{{
				Name: "mutate.tunnel.test", ClientConfig: opts.Service.ClientConfig(), Rules: rules,
				FailurePolicy: &fail, SideEffects: &none, TimeoutSeconds: &timeout,
				AdmissionReviewVersions: []string{"v1"},
				NamespaceSelector:       &metav1.LabelSelector{}, ObjectSelector: &metav1.LabelSelector{},
			}},
		})
	}
	return append(objects, &admissionregistrationv1.ValidatingWebhookConfiguration{
		ObjectMeta: metav1.ObjectMeta{Name: "tunneled"},
		Webhooks: []admissionregistrationv1.ValidatingWebhook{{
			Name: "validate.tunnel.test", ClientConfig: opts.Service.ClientConfig(), Rules: rules,
			FailurePolicy: &fail, SideEffects: &none, TimeoutSeconds: &timeout,
			AdmissionReviewVersions: []string{"v1"},
			NamespaceSelector:       &metav1.LabelSelector{}, ObjectSelector: &metav1.LabelSelector{},
		}},
	})
}

// admissionConfig is a WebhookAdmissionConfiguration whose kubeconfig gives
// kcp's client certificate to every *.svc webhook, as an operator would.
func admissionConfig(t T, cert *devca.Issued) io.Reader {
	if cert == nil {
		return nil
	}
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "client.crt"), filepath.Join(dir, "client.key")
	must(t, os.WriteFile(certFile, cert.CertPEM, 0o600))
	must(t, os.WriteFile(keyFile, cert.KeyPEM, 0o600))
	kubeconfig := filepath.Join(dir, "kubeconfig")
	must(t, os.WriteFile(kubeconfig, []byte(fmt.Sprintf(`apiVersion: v1
kind: Config
users:
- name: "*.svc"
  user:
    client-certificate: %s
    client-key: %s
`, certFile, keyFile)), 0o600))
	return bytes.NewReader([]byte(fmt.Sprintf(`apiVersion: apiserver.config.k8s.io/v1
kind: WebhookAdmissionConfiguration
kubeConfigFile: %s
`, kubeconfig)))
}

// Admit sends a ConfigMap create through the plugin and returns the object
// as admitted (mutated, for a mutating plugin) and the plugin's verdict.
func (a *Admission) Admit(ctx context.Context, cm *corev1.ConfigMap) (*corev1.ConfigMap, error) {
	cm = cm.DeepCopy()
	attrs := admission.NewAttributesRecord(cm, nil, corev1.SchemeGroupVersion.WithKind("ConfigMap"),
		cm.Namespace, cm.Name, corev1.SchemeGroupVersion.WithResource("configmaps"), "",
		admission.Create, &metav1.CreateOptions{}, false, &user.DefaultInfo{Name: "alice"})
	o := admission.NewObjectInterfacesFromScheme(scheme.Scheme)
	// The plugin's webhook source syncs lazily after its informer does.
	for deadline := time.Now().Add(10 * time.Second); ; {
		var err error
		if a.mutate != nil {
			err = a.mutate.Admit(ctx, attrs, o)
		} else {
			err = a.validate.Validate(ctx, attrs, o)
		}
		if err != nil && strings.Contains(err.Error(), "not yet ready") && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
			continue
		}
		return attrs.GetObject().(*corev1.ConfigMap), err
	}
}

func must(t T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
