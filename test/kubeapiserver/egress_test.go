package kubeapiserver

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// The hosted-control-plane shape: the real kube-apiserver stores the
// Services and EndpointSlices, an agent in plain mode resolves them
// against it, and the webhook "pod" listens at an address of the isolated
// network behind a ClusterIP that nothing routes. The API server's
// --egress-selector-config-file points at the broker's CONNECT front end,
// once over a Unix socket and once over TCP with mTLS (its own SVID): a
// ValidatingWebhookConfiguration with a Service reference and a caBundle
// admits and denies through the tunnel, TLS end to end, and an APIService
// backed by the same Service answers GET /apis/<group>/<version> through
// it (the aggregated-API case). Run alone with:
// cd test && go test -run Egress ./...
func TestEgressSelectorCallsWebhooksAndAggregatedAPIsThroughTheBroker(t *testing.T) {
	for _, transport := range []string{"uds", "mtls"} {
		t.Run(transport, func(t *testing.T) {
			w := newWorld(t)
			ns := w.plainNamespace()
			ip := newIP()
			var reviewed atomic.Int64
			// One server is both the webhook (at /) and an aggregated API
			// server (at /apis/), behind one Service.
			mux := http.NewServeMux()
			mux.Handle("/", harness.AdmissionHandler(func(req *admissionv1.AdmissionRequest, _ string) *admissionv1.AdmissionResponse {
				reviewed.Add(1)
				if strings.HasPrefix(req.Name, "deny-") {
					return &admissionv1.AdmissionResponse{Allowed: false, Result: &metav1.Status{Message: "denied by the egress test webhook"}}
				}
				return &admissionv1.AdmissionResponse{Allowed: true}
			}))
			mux.HandleFunc("/apis/", serveAPIResources)
			hook := harness.StartTLSWebhook(t, harness.WebhookOptions{Namespace: ns, Name: "webhook", Listen: net.JoinHostPort(ip, "8443")}, mux)
			w.service(ns, "webhook", intstr.FromInt32(8443))
			w.mustSetEndpoints(ns, "webhook", "webhook-abcde", 8443, ready(ip)...)
			w.startAgent(lookup.KubeOptions{PlainCluster: "hcp"})
			socket := w.serveEgress(transport)
			w.validatingWebhook(ns, hook.CABundle)

			configMaps := w.admin.CoreV1().ConfigMaps(ns)
			var err error
			attempt := 0
			harness.Eventually(t, 90*time.Second, "the webhook to deny a ConfigMap through the tunnel", func() bool {
				attempt++
				_, err = configMaps.Create(context.Background(), &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("deny-%d", attempt)}}, metav1.CreateOptions{})
				return err != nil && strings.Contains(err.Error(), "denied by the egress test webhook")
			})
			t.Logf("denied: %v", err)
			before := reviewed.Load()
			if _, err := configMaps.Create(context.Background(), &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "allow-1"}}, metav1.CreateOptions{}); err != nil {
				t.Fatalf("the webhook should admit allow-1: %v", err)
			}
			if reviewed.Load() == before {
				t.Fatal("allow-1 was admitted without a call to the webhook")
			}
			w.apiService(ns, hook.CABundle)
			if socket != "" {
				w.checkRefusals(socket, ns)
			}
		})
	}
}

// serveEgress serves a CONNECT front end of the world's broker for
// cluster hcp, restarts the API server with an egress selector
// configuration that points at it, and returns the socket's path (empty
// for mTLS).
func (w *world) serveEgress(transport string) string {
	w.t.Helper()
	dir := w.t.TempDir()
	var config, socket string
	var l net.Listener
	var err error
	switch transport {
	case "uds":
		socket = filepath.Join(dir, "egress.sock")
		l, err = net.Listen("unix", socket)
		config = fmt.Sprintf("      uds:\n        udsName: %s\n", socket)
	default:
		svid := w.env.SVID("/kube-apiserver")
		l, err = net.Listen("tcp", "127.0.0.1:0")
		config = fmt.Sprintf("      tcp:\n        url: https://%s\n        tlsConfig:\n          caBundle: %s\n          clientCert: %s\n          clientKey: %s\n",
			l.Addr(), svid.Bundle, svid.Cert, svid.Key)
	}
	if err != nil {
		w.t.Fatal(err)
	}
	front := w.broker.Server.EgressTLS()
	if transport == "uds" {
		front = w.broker.Server.EgressUDS("hcp")
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- front.Serve(ctx, l) }()
	w.t.Cleanup(func() { w.broker.Stop(); cancel(); <-served })

	path := filepath.Join(dir, "egress-selector.yaml")
	file := "apiVersion: apiserver.k8s.io/v1beta1\nkind: EgressSelectorConfiguration\negressSelections:\n- name: cluster\n  connection:\n    proxyProtocol: HTTPConnect\n    transport:\n" + config
	if err := os.WriteFile(path, []byte(file), 0o600); err != nil {
		w.t.Fatal(err)
	}
	w.restartAPIServer("--egress-selector-config-file=" + path)
	w.t.Cleanup(func() { w.restartAPIServer() })
	return socket
}

// restartAPIServer restarts the shared API server with args added.
func (w *world) restartAPIServer(args ...string) {
	w.t.Helper()
	w.kube.ExtraArgs = args
	if err := w.kube.StopAPIServer(); err != nil {
		w.t.Fatal(err)
	}
	if err := w.kube.StartAPIServer(); err != nil {
		w.t.Fatal(err)
	}
}

// validatingWebhook configures the webhook Service of ns, with caBundle,
// for ConfigMaps created in ns.
func (w *world) validatingWebhook(ns string, caBundle []byte) {
	w.t.Helper()
	fail, none := admissionregistrationv1.Fail, admissionregistrationv1.SideEffectClassNone
	path, port, timeout := "/", int32(443), int32(10)
	cfg := &admissionregistrationv1.ValidatingWebhookConfiguration{
		ObjectMeta: metav1.ObjectMeta{Name: "egress-" + ns},
		Webhooks: []admissionregistrationv1.ValidatingWebhook{{
			Name: "egress.test.example.org",
			ClientConfig: admissionregistrationv1.WebhookClientConfig{
				Service:  &admissionregistrationv1.ServiceReference{Namespace: ns, Name: "webhook", Path: &path, Port: &port},
				CABundle: caBundle,
			},
			Rules: []admissionregistrationv1.RuleWithOperations{{
				Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create},
				Rule:       admissionregistrationv1.Rule{APIGroups: []string{""}, APIVersions: []string{"v1"}, Resources: []string{"configmaps"}},
			}},
			NamespaceSelector:       &metav1.LabelSelector{MatchLabels: map[string]string{corev1.LabelMetadataName: ns}},
			FailurePolicy:           &fail,
			SideEffects:             &none,
			AdmissionReviewVersions: []string{"v1"},
			TimeoutSeconds:          &timeout,
		}},
	}
	webhooks := w.admin.AdmissionregistrationV1().ValidatingWebhookConfigurations()
	if _, err := webhooks.Create(context.Background(), cfg, metav1.CreateOptions{}); err != nil {
		w.t.Fatal(err)
	}
	w.t.Cleanup(func() { _ = webhooks.Delete(context.Background(), cfg.Name, metav1.DeleteOptions{}) })
}

// checkRefusals sends CONNECTs the API server could be made to send, for
// addresses that are no Service of the cluster, and checks the refusals.
func (w *world) checkRefusals(socket, ns string) {
	w.t.Helper()
	svc, err := w.admin.CoreV1().Services(ns).Get(context.Background(), "webhook", metav1.GetOptions{})
	if err != nil {
		w.t.Fatal(err)
	}
	for _, c := range []struct {
		what, authority string
		want            int
	}{
		{"a ClusterIP that belongs to no Service", net.JoinHostPort(w.unusedClusterIP(svc.Spec.ClusterIP), "443"), http.StatusForbidden},
		{"a port the Service does not declare", net.JoinHostPort(svc.Spec.ClusterIP, "444"), http.StatusNotFound},
		{"the API server's own address", net.JoinHostPort(harness.IsolatedAPIServerIP, "6443"), http.StatusForbidden},
		{"the API server's Service", "10.0.0.1:443", http.StatusForbidden},
	} {
		code, body := connectOnce(w.t, socket, c.authority)
		if code != c.want {
			w.t.Errorf("%s (%s): answer %d %q, want %d", c.what, c.authority, code, body, c.want)
			continue
		}
		w.t.Logf("%s (%s): %d %s", c.what, c.authority, code, body)
	}
}

// connectOnce sends one CONNECT over the socket and reads the answer.
func connectOnce(t *testing.T, socket, authority string) (int, string) {
	t.Helper()
	conn, err := net.Dial("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(20 * time.Second))
	if _, err := fmt.Fprintf(conn, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", authority, authority); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), &http.Request{Method: http.MethodConnect})
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var body strings.Builder
	_, _ = bufio.NewReader(resp.Body).WriteTo(&body)
	return resp.StatusCode, strings.TrimSpace(body.String())
}

// The aggregated API the webhook's server also serves.
const aggregatedGroup, aggregatedVersion = "egress.example.org", "v1"

// serveAPIResources answers discovery of the aggregated group version, as
// an aggregated API server does; the aggregator's availability check and
// a client's GET /apis/<group>/<version> both land here.
func serveAPIResources(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/apis/"+aggregatedGroup+"/"+aggregatedVersion {
		http.NotFound(w, r)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	fmt.Fprintf(w, `{"kind":"APIResourceList","apiVersion":"v1","groupVersion":"%s/%s","resources":[{"name":"gadgets","singularName":"gadget","namespaced":true,"kind":"Gadget","verbs":["get","list"]}]}`,
		aggregatedGroup, aggregatedVersion)
}

// apiService registers the webhook Service of ns as the aggregated API
// server of aggregatedGroup, with caBundle, and checks that
// GET /apis/<group>/<version> reaches it through the tunnel.
func (w *world) apiService(ns string, caBundle []byte) {
	w.t.Helper()
	name := aggregatedVersion + "." + aggregatedGroup
	body, err := json.Marshal(map[string]any{
		"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
		"metadata": map[string]any{"name": name},
		"spec": map[string]any{
			"group": aggregatedGroup, "version": aggregatedVersion,
			"service":              map[string]any{"namespace": ns, "name": "webhook", "port": 443},
			"caBundle":             caBundle,
			"groupPriorityMinimum": 1000, "versionPriority": 15,
		},
	})
	if err != nil {
		w.t.Fatal(err)
	}
	rest := w.admin.Discovery().RESTClient()
	const apiServices = "/apis/apiregistration.k8s.io/v1/apiservices"
	if _, err := rest.Post().AbsPath(apiServices).Body(body).SetHeader("Content-Type", "application/json").DoRaw(context.Background()); err != nil {
		w.t.Fatal(err)
	}
	w.t.Cleanup(func() { _, _ = rest.Delete().AbsPath(apiServices, name).DoRaw(context.Background()) })
	var got []byte
	harness.Eventually(w.t, 90*time.Second, "GET /apis/"+aggregatedGroup+"/"+aggregatedVersion+" to reach the aggregated API server", func() bool {
		got, err = rest.Get().AbsPath("/apis", aggregatedGroup, aggregatedVersion).DoRaw(context.Background())
		return err == nil && strings.Contains(string(got), `"gadgets"`)
	})
	w.t.Logf("GET /apis/%s/%s: %s", aggregatedGroup, aggregatedVersion, got)
}
