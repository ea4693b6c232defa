package realkcp

import (
	"context"
	"fmt"
	"maps"
	"net"
	"slices"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// loadCalls is how many admission calls, and conversions, the keep-alive
// test makes through each path.
const loadCalls = 1000

// idleBound is how long kcp keeps an idle webhook connection: client-go's
// transports close idle connections after Go's default 90 s, and the
// tunnel ends with its connection.
const idleBound = 90 * time.Second

// kcp keeps its webhook connections: loadCalls admission calls through the
// tunnel, one after another, ride the connection the first call opened,
// and so do loadCalls conversions; idle, they are closed within idleBound,
// tunnels included. The same calls to the same webhook reached by URL, and
// creations with no webhook, run interleaved in the same run: the figures
// (logged) are what kcp's users pay for the tunnel.
func TestRealKCPKeepsItsWebhookConnections(t *testing.T) {
	s := kcp(t)
	ctx := context.Background()
	tunneled, byURL, none := s.workspace(t, "tunnel"), s.workspace(t, "url"), s.workspace(t, "none")
	admission := s.startStandIn(t, "tunnel")
	direct := startStandInWith(t, "url", harness.WebhookOptions{Namespace: "webhooks", Name: "webhook", CA: s.ca, IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	converter := harness.StartTLSWebhook(t, harness.WebhookOptions{Namespace: "webhooks", Name: "converter", CA: s.ca}, harness.ConversionHandler("tunnel"))
	converterByURL := harness.StartTLSWebhook(t, harness.WebhookOptions{Namespace: "webhooks", Name: "converter", CA: s.ca, IPs: []net.IP{net.IPv4(127, 0, 0, 1)}}, harness.ConversionHandler("url"))

	// One agent serves both webhook Services of the tunneled workspace.
	s.bind("keepalive", tunneled.cluster)
	env := &harness.Env{T: t, Dir: t.TempDir(), CA: s.env.CA}
	env.StartAgentProcess(s.broker, "/agent/keepalive", lookupFile(tunneled.cluster, map[string]string{
		"webhook": admission.Addr, "converter": converter.Addr,
	}))

	tunneled.validating(t, admission.CABundle, admissionregistrationv1.Fail)
	byURL.validatingURL(t, "https://"+direct.Addr+"/validate", direct.CABundle)
	tunneled.eventuallyRefused(t, true, "denied by webhook tunnel")
	byURL.eventuallyRefused(t, true, "denied by webhook url")

	widgetCRD := func(cc apiextensionsv1.WebhookClientConfig) *apiextensionsv1.CustomResourceDefinition {
		crd := harness.WidgetCRD(harness.WebhookService{})
		crd.Spec.Conversion.Webhook.ClientConfig = &cc
		return crd
	}
	path, port := "/convert", int32(443)
	s.createCRD(t, tunneled, widgetCRD(apiextensionsv1.WebhookClientConfig{
		Service:  &apiextensionsv1.ServiceReference{Namespace: "webhooks", Name: "converter", Path: &path, Port: &port},
		CABundle: converter.CABundle,
	}))
	url := "https://" + converterByURL.Addr + "/convert"
	s.createCRD(t, byURL, widgetCRD(apiextensionsv1.WebhookClientConfig{URL: &url, CABundle: converterByURL.CABundle}))
	v1 := schema.GroupVersionResource{Group: harness.WidgetGroup, Version: "v1", Resource: "widgets"}
	v2 := schema.GroupVersionResource{Group: harness.WidgetGroup, Version: "v2", Resource: "widgets"}
	for _, w := range []*workspace{tunneled, byURL} {
		eventually(t, "a Widget created in "+w.path, func() (bool, string) {
			_, err := w.dyn.Resource(v1).Namespace(namespace).Create(ctx, harness.Widget(namespace, "w", "3"), metav1.CreateOptions{})
			return err == nil, errText(err)
		})
		eventually(t, "a Widget of "+w.path+" read as v2", func() (bool, string) {
			_, err := w.dyn.Resource(v2).Namespace(namespace).Get(ctx, "w", metav1.GetOptions{})
			return err == nil, errText(err)
		})
	}

	// Warmed up: every path has made its first call. From here on, count.
	admissionOpened, _ := admission.Connections()
	converterOpened, _ := converter.Connections()
	dials := s.brokerDials(t)
	reviewed := len(admission.reviewed)

	// A client free of client-go's default 5 QPS, which would otherwise set
	// every figure.
	fast := func(w *workspace) (kubernetes.Interface, dynamic.Interface) {
		cfg := s.config(w.path)
		cfg.QPS, cfg.Burst = -1, 0
		return kubernetes.NewForConfigOrDie(cfg), dynamic.NewForConfigOrDie(cfg)
	}
	series := map[string][]time.Duration{}
	timed := func(name string, call func() error) {
		start := time.Now()
		if err := call(); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		series[name] = append(series[name], time.Since(start))
	}
	create := func(kube kubernetes.Interface, i int) func() error {
		return func() error {
			_, err := kube.CoreV1().ConfigMaps(namespace).Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{
				Name: fmt.Sprintf("load-%d", i), Labels: map[string]string{"test": "realkcp"},
			}}, metav1.CreateOptions{})
			return err
		}
	}
	get := func(dyn dynamic.Interface, gvr schema.GroupVersionResource) func() error {
		return func() error {
			_, err := dyn.Resource(gvr).Namespace(namespace).Get(ctx, "w", metav1.GetOptions{})
			return err
		}
	}
	tunneledKube, tunneledDyn := fast(tunneled)
	byURLKube, byURLDyn := fast(byURL)
	noneKube, _ := fast(none)
	for i := range loadCalls {
		timed("admission, webhook through the tunnel", create(tunneledKube, i))
		timed("admission, the same webhook by URL", create(byURLKube, i))
		timed("admission, no webhook", create(noneKube, i))
		timed("conversion, webhook through the tunnel", get(tunneledDyn, v2))
		timed("conversion, the same webhook by URL", get(byURLDyn, v2))
		timed("no conversion (read as stored)", get(tunneledDyn, v1))
	}
	for _, name := range slices.Sorted(maps.Keys(series)) {
		p50, p99 := percentiles(series[name])
		t.Logf("%-40s %d calls: p50 %v, p99 %v", name, len(series[name]), p50, p99)
	}

	if got := len(admission.reviewed) - reviewed; got < loadCalls {
		t.Fatalf("the webhook reviewed %d of the %d ConfigMaps", got, loadCalls)
	}
	opened, _ := admission.Connections()
	convOpened, _ := converter.Connections()
	dialed := s.brokerDials(t) - dials
	t.Logf("through the tunnel: %d admission calls opened %d connections, %d conversions %d; the broker dialed %v tunnels",
		loadCalls, opened-admissionOpened, loadCalls, convOpened-converterOpened, dialed)
	// A handful at most, were kcp to lose one: one per call is what the
	// test is there to catch.
	if opened-admissionOpened > 2 || convOpened-converterOpened > 2 || dialed > 4 {
		t.Errorf("kcp opened %d connections for %d admission calls and %d for %d conversions (%v tunnels): it should keep them",
			opened-admissionOpened, loadCalls, convOpened-converterOpened, loadCalls, dialed)
	}
	s.assertKCPTunnels(t, tunneled.cluster, "keepalive", "webhook", "converter")

	// Idle, they go: the connections at the webhooks, and the tunnels.
	idleSince := time.Now()
	harness.Eventually(t, idleBound+30*time.Second, "kcp to close its idle webhook connections", func() bool {
		_, a := admission.Connections()
		_, c := converter.Connections()
		return a == 0 && c == 0 && len(s.tunnels(t, tunneled.cluster)) == 0
	})
	t.Logf("idle webhook connections and their tunnels closed %v after the last call", time.Since(idleSince).Round(time.Second))
}

// A webhook configuration with a URL is none of the tunnel's business: kcp
// calls the URL as it always does, and the broker dials nothing for it.
func TestRealKCPURLWebhookBypassesTheTunnel(t *testing.T) {
	s := kcp(t)
	w := s.workspace(t, "url")
	wh := startStandInWith(t, "url", harness.WebhookOptions{Namespace: "webhooks", Name: "webhook", CA: s.ca, IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	dials := s.brokerDials(t)
	w.validatingURL(t, "https://"+wh.Addr+"/validate", wh.CABundle)
	w.eventuallyRefused(t, true, "denied by webhook url")
	if _, err := w.createConfigMap("allowed", false); err != nil {
		t.Fatalf("a ConfigMap the webhook allows: %v", err)
	}
	if !wh.saw(w.cluster, "allowed") {
		t.Errorf("the URL webhook did not review ConfigMap allowed of cluster %s: it reviewed %v", w.cluster, wh.reviewed)
	}
	if got := s.brokerDials(t) - dials; got != 0 {
		t.Errorf("the broker dialed %v tunnels for a URL webhook", got)
	}
	if got := s.tunnels(t, w.cluster); len(got) != 0 {
		t.Errorf("the broker holds %d tunnels to cluster %s, whose only webhook is a URL", len(got), w.cluster)
	}
}

// validatingURL creates ValidatingWebhookConfiguration "realkcp" in w for
// ConfigMaps, whose webhook is url.
func (w *workspace) validatingURL(t *testing.T, url string, caBundle []byte) {
	t.Helper()
	cc, rules, objects := webhook("/validate", "", "configmaps", caBundle)
	cc.Service, cc.URL = nil, &url
	w.createValidating(t, cc, rules, objects, admissionregistrationv1.Fail)
}

// percentiles are the 50th and 99th percentiles of d.
func percentiles(d []time.Duration) (p50, p99 time.Duration) {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)*50/100], s[len(s)*99/100]
}
