package realkcp

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	admissionv1 "k8s.io/api/admission/v1"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// probes numbers the ConfigMaps that eventuallyRefused creates.
var probes atomic.Uint32

// clusterAnnotation is where kcp's webhook plugins tell a webhook which
// logical cluster the object is in.
const clusterAnnotation = "kcp.io/cluster"

// standIn is a webhook pod's stand-in: a TLS server for Service
// webhooks/webhook with a certificate of the tests' one webhook CA, that denies objects labelled
// deny=yes (/validate) or labels them mutated-by=<name> (/mutate), and
// remembers what it reviewed. It listens on listen, or a loopback port.
type standIn struct {
	name string
	*harness.Webhook

	mu       sync.Mutex
	reviewed []string // cluster/name of each object, as kcp sent it
}

func (srv *server) startStandIn(t *testing.T, name string, listen ...string) *standIn {
	t.Helper()
	opts := harness.WebhookOptions{Namespace: "webhooks", Name: "webhook", CA: srv.ca}
	if len(listen) > 0 {
		opts.Listen = listen[0]
	}
	return startStandInWith(t, name, opts)
}

func startStandInWith(t *testing.T, name string, opts harness.WebhookOptions) *standIn {
	t.Helper()
	s := &standIn{name: name}
	mux := http.NewServeMux()
	mux.Handle("/validate", harness.AdmissionHandler(s.validate))
	mux.Handle("/mutate", harness.AdmissionHandler(s.mutate))
	s.Webhook = harness.StartTLSWebhook(t, opts, mux)
	return s
}

// record notes the object of req and returns its labels.
func (s *standIn) record(req *admissionv1.AdmissionRequest) map[string]string {
	var obj struct {
		Metadata metav1.ObjectMeta `json:"metadata"`
	}
	_ = json.Unmarshal(req.Object.Raw, &obj)
	name := obj.Metadata.Name
	if name == "" {
		name = obj.Metadata.GenerateName
	}
	s.mu.Lock()
	s.reviewed = append(s.reviewed, obj.Metadata.Annotations[clusterAnnotation]+"/"+name)
	s.mu.Unlock()
	return obj.Metadata.Labels
}

func (s *standIn) validate(req *admissionv1.AdmissionRequest, _ string) *admissionv1.AdmissionResponse {
	if s.record(req)["deny"] == "yes" {
		return &admissionv1.AdmissionResponse{Result: &metav1.Status{Code: http.StatusForbidden,
			Message: fmt.Sprintf("denied by webhook %s", s.name)}}
	}
	return &admissionv1.AdmissionResponse{Allowed: true}
}

func (s *standIn) mutate(req *admissionv1.AdmissionRequest, _ string) *admissionv1.AdmissionResponse {
	s.record(req)
	patch := fmt.Sprintf(`[{"op":"add","path":"/metadata/labels/mutated-by","value":%q}]`, s.name)
	pt := admissionv1.PatchTypeJSONPatch
	return &admissionv1.AdmissionResponse{Allowed: true, Patch: []byte(patch), PatchType: &pt}
}

// saw says whether s reviewed the object name of cluster.
func (s *standIn) saw(cluster, name string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, r := range s.reviewed {
		if r == cluster+"/"+name {
			return true
		}
	}
	return false
}

// clusters is the set of clusters whose objects s reviewed.
func (s *standIn) clusters() map[string]bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	seen := map[string]bool{}
	for _, r := range s.reviewed {
		seen[r[:strings.Index(r, "/")]] = true
	}
	return seen
}

// webhook is a webhook of a configuration: Service webhooks/webhook port
// 443 at path, for creations of resource in group, of objects labelled
// test=realkcp.
func webhook(path, group, resource string, caBundle []byte) (admissionregistrationv1.WebhookClientConfig, []admissionregistrationv1.RuleWithOperations, *metav1.LabelSelector) {
	port := int32(443)
	scope := admissionregistrationv1.NamespacedScope
	return admissionregistrationv1.WebhookClientConfig{
			Service:  &admissionregistrationv1.ServiceReference{Namespace: "webhooks", Name: "webhook", Path: &path, Port: &port},
			CABundle: caBundle,
		}, []admissionregistrationv1.RuleWithOperations{{
			Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create},
			Rule:       admissionregistrationv1.Rule{APIGroups: []string{group}, APIVersions: []string{"*"}, Resources: []string{resource}, Scope: &scope},
		}}, &metav1.LabelSelector{MatchLabels: map[string]string{"test": "realkcp"}}
}

// validating creates ValidatingWebhookConfiguration "realkcp" in w, for
// ConfigMaps unless group and resource say otherwise.
func (w *workspace) validating(t *testing.T, caBundle []byte, policy admissionregistrationv1.FailurePolicyType, groupResource ...string) {
	t.Helper()
	group, resource := "", "configmaps"
	if len(groupResource) == 2 {
		group, resource = groupResource[0], groupResource[1]
	}
	cc, rules, objects := webhook("/validate", group, resource, caBundle)
	w.createValidating(t, cc, rules, objects, policy)
}

// createValidating creates ValidatingWebhookConfiguration "realkcp" in w
// with one webhook.
func (w *workspace) createValidating(t *testing.T, cc admissionregistrationv1.WebhookClientConfig, rules []admissionregistrationv1.RuleWithOperations,
	objects *metav1.LabelSelector, policy admissionregistrationv1.FailurePolicyType) {
	t.Helper()
	none, timeout := admissionregistrationv1.SideEffectClassNone, int32(15)
	_, err := w.kube.AdmissionregistrationV1().ValidatingWebhookConfigurations().Create(context.Background(),
		&admissionregistrationv1.ValidatingWebhookConfiguration{
			ObjectMeta: metav1.ObjectMeta{Name: "realkcp"},
			Webhooks: []admissionregistrationv1.ValidatingWebhook{{
				Name: "validate.realkcp.test", ClientConfig: cc, Rules: rules, ObjectSelector: objects,
				FailurePolicy: &policy, SideEffects: &none, TimeoutSeconds: &timeout, AdmissionReviewVersions: []string{"v1"},
			}},
		}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
}

// setFailurePolicy changes the failure policy of w's validating webhook.
func (w *workspace) setFailurePolicy(t *testing.T, policy admissionregistrationv1.FailurePolicyType) {
	t.Helper()
	configs := w.kube.AdmissionregistrationV1().ValidatingWebhookConfigurations()
	cfg, err := configs.Get(context.Background(), "realkcp", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cfg.Webhooks[0].FailurePolicy = &policy
	if _, err := configs.Update(context.Background(), cfg, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// createConfigMap creates a ConfigMap in w labelled for the webhooks, and
// deny=yes if deny; it returns the object kcp stored.
func (w *workspace) createConfigMap(name string, deny bool) (*corev1.ConfigMap, error) {
	labels := map[string]string{"test": "realkcp"}
	if deny {
		labels["deny"] = "yes"
	}
	return w.kube.CoreV1().ConfigMaps(namespace).Create(context.Background(),
		&corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}, metav1.CreateOptions{})
}

// eventuallyRefused creates ConfigMaps (deny=yes if deny) until kcp refuses
// one with a message that holds want: kcp's webhook plugins see a new
// configuration a moment after it was written. It returns the message.
func (w *workspace) eventuallyRefused(t *testing.T, deny bool, want string) string {
	t.Helper()
	msg := eventually(t, fmt.Sprintf("kcp to refuse a ConfigMap in %s with %q", w.path, want), func() (bool, string) {
		_, err := w.createConfigMap(fmt.Sprintf("probe-%d", probes.Add(1)), deny)
		return err != nil && strings.Contains(errText(err), want), errText(err)
	})
	t.Logf("kcp refused: %s", msg)
	return msg
}

// A ValidatingWebhookConfiguration in a workspace whose Service an agent
// serves: kcp's own validating plugin calls the webhook through the tunnel,
// with the configuration's caBundle, and the webhook's answer decides.
func TestRealKCPValidatingWebhookThroughTheTunnel(t *testing.T) {
	s := kcp(t)
	w := s.workspace(t, "a")
	wh := s.startStandIn(t, "a")
	s.agent(t, "a", w.cluster, wh.Addr)
	w.validating(t, wh.CABundle, admissionregistrationv1.Fail)

	msg := w.eventuallyRefused(t, true, "denied by webhook a")
	if !strings.Contains(msg, `admission webhook "validate.realkcp.test" denied the request`) {
		t.Errorf("kcp's refusal %q does not name the webhook", msg)
	}
	if _, err := w.createConfigMap("allowed", false); err != nil {
		t.Fatalf("a ConfigMap the webhook allows: %v", err)
	}
	if !wh.saw(w.cluster, "allowed") {
		t.Errorf("the webhook did not review ConfigMap allowed of cluster %s: it reviewed %v", w.cluster, wh.reviewed)
	}
	s.assertKCPTunnels(t, w.cluster, "a")
}

// assertKCPTunnels checks the broker's side: kcp keeps its webhook
// connections, so the broker holds tunnels to cluster, and every one was
// dialed by kcp (/kcp), for a webhook Service of that cluster (namespace
// webhooks; webhooks/webhook unless services says which), and carried by
// agent /agent/<agent>.
func (s *server) assertKCPTunnels(t *testing.T, cluster, agent string, services ...string) {
	t.Helper()
	if len(services) == 0 {
		services = []string{"webhook"}
	}
	tunnels := s.tunnels(t, cluster)
	if len(tunnels) == 0 {
		t.Fatalf("the broker holds no tunnel to cluster %s, though kcp keeps its webhook connections", cluster)
	}
	for _, tun := range tunnels {
		if tun.CallerSpiffeId != harness.ID("/kcp").String() || tun.Target.GetCluster() != cluster ||
			tun.Target.GetNamespace() != "webhooks" || !slices.Contains(services, tun.Target.GetService()) ||
			tun.AgentSpiffeId != harness.ID("/agent/"+agent).String() {
			t.Errorf("tunnel %s: caller %s, target %v, agent %s; want /kcp to webhooks/%v of %s through /agent/%s",
				tun.TunnelId, tun.CallerSpiffeId, tun.Target, tun.AgentSpiffeId, services, cluster, agent)
		}
	}
}

// A MutatingWebhookConfiguration: kcp's mutating plugin applies the patch
// the webhook returned through the tunnel.
func TestRealKCPMutatingWebhookThroughTheTunnel(t *testing.T) {
	s := kcp(t)
	w := s.workspace(t, "m")
	wh := s.startStandIn(t, "m")
	s.agent(t, "m", w.cluster, wh.Addr)
	cc, rules, objects := webhook("/mutate", "", "configmaps", wh.CABundle)
	fail, none, timeout := admissionregistrationv1.Fail, admissionregistrationv1.SideEffectClassNone, int32(15)
	_, err := w.kube.AdmissionregistrationV1().MutatingWebhookConfigurations().Create(context.Background(),
		&admissionregistrationv1.MutatingWebhookConfiguration{
			ObjectMeta: metav1.ObjectMeta{Name: "realkcp"},
			Webhooks: []admissionregistrationv1.MutatingWebhook{{
				Name: "mutate.realkcp.test", ClientConfig: cc, Rules: rules, ObjectSelector: objects,
				FailurePolicy: &fail, SideEffects: &none, TimeoutSeconds: &timeout, AdmissionReviewVersions: []string{"v1"},
			}},
		}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}

	var got *corev1.ConfigMap
	n := 0
	eventually(t, "a ConfigMap patched by the webhook", func() (bool, string) {
		n++
		got, err = w.createConfigMap(fmt.Sprintf("patched-%d", n), false)
		if err != nil {
			t.Fatalf("creating a ConfigMap: %v", err)
		}
		return got.Labels["mutated-by"] != "", fmt.Sprintf("ConfigMap %s has labels %v", got.Name, got.Labels)
	})
	if got.Labels["mutated-by"] != "m" {
		t.Fatalf("ConfigMap %s has label mutated-by=%q, want m", got.Name, got.Labels["mutated-by"])
	}
	if !wh.saw(w.cluster, got.Name) {
		t.Errorf("the webhook did not review ConfigMap %s of cluster %s: it reviewed %v", got.Name, w.cluster, wh.reviewed)
	}
}

// Two workspaces, each with a configuration for the same Service name, each
// served by an agent of its own: each reaches its own webhook, never the
// other's.
func TestRealKCPSameServiceInTwoWorkspaces(t *testing.T) {
	s := kcp(t)
	a, b := s.workspace(t, "a"), s.workspace(t, "b")
	whA, whB := s.startStandIn(t, "a"), s.startStandIn(t, "b")
	s.agent(t, "a", a.cluster, whA.Addr)
	s.agent(t, "b", b.cluster, whB.Addr)
	a.validating(t, whA.CABundle, admissionregistrationv1.Fail)
	b.validating(t, whB.CABundle, admissionregistrationv1.Fail)

	a.eventuallyRefused(t, true, "denied by webhook a")
	b.eventuallyRefused(t, true, "denied by webhook b")
	for _, w := range []*workspace{a, b} {
		if _, err := w.createConfigMap("allowed", false); err != nil {
			t.Fatalf("%s: a ConfigMap the webhook allows: %v", w.path, err)
		}
	}
	if !whA.saw(a.cluster, "allowed") || !whB.saw(b.cluster, "allowed") {
		t.Errorf("each webhook should have reviewed its workspace's ConfigMap allowed: a reviewed %v, b %v", whA.reviewed, whB.reviewed)
	}
	if got := whA.clusters(); len(got) != 1 || !got[a.cluster] {
		t.Errorf("webhook a reviewed objects of clusters %v, want only %s", got, a.cluster)
	}
	if got := whB.clusters(); len(got) != 1 || !got[b.cluster] {
		t.Errorf("webhook b reviewed objects of clusters %v, want only %s", got, b.cluster)
	}
	s.assertKCPTunnels(t, a.cluster, "a")
	s.assertKCPTunnels(t, b.cluster, "b")
}

// The agent that served the webhook's Service is gone: kcp fails the
// request with the dial's error, as the broker words it, and lets it
// through once the configuration says failurePolicy: Ignore.
func TestRealKCPAgentGone(t *testing.T) {
	s := kcp(t)
	w := s.workspace(t, "gone")
	wh := s.startStandIn(t, "gone")
	agent := s.agent(t, "gone", w.cluster, wh.Addr)
	w.validating(t, wh.CABundle, admissionregistrationv1.Fail)
	w.eventuallyRefused(t, true, "denied by webhook gone")

	// Gone as a pod on a failed node is: killed, its streams cut.
	agent.Kill()
	want := fmt.Sprintf("no agent serves logical cluster %q", w.cluster)
	msg := w.eventuallyRefused(t, false, want)
	if !strings.Contains(msg, `failed calling webhook "validate.realkcp.test"`) {
		t.Errorf("kcp's refusal %q does not say which webhook it failed to call", msg)
	}

	w.setFailurePolicy(t, admissionregistrationv1.Ignore)
	n := 0
	eventually(t, "failurePolicy Ignore to let a ConfigMap through", func() (bool, string) {
		n++
		_, err := w.createConfigMap(fmt.Sprintf("ignored-%d", n), true)
		return err == nil, errText(err)
	})
}

// A caBundle that is not the webhook's CA: TLS, end to end through the
// tunnel, fails, and the webhook never sees the request.
func TestRealKCPWrongCABundle(t *testing.T) {
	s := kcp(t)
	w := s.workspace(t, "ca")
	// other's CA is not the webhooks' CA.
	wh, other := s.startStandIn(t, "ca"), startStandInWith(t, "other", harness.WebhookOptions{Namespace: "webhooks", Name: "webhook"})
	s.agent(t, "ca", w.cluster, wh.Addr)
	w.validating(t, other.CABundle, admissionregistrationv1.Fail)

	msg := w.eventuallyRefused(t, false, `failed calling webhook "validate.realkcp.test"`)
	if !strings.Contains(msg, "x509: certificate signed by unknown authority") {
		t.Errorf("kcp's refusal %q does not say that the webhook's certificate is not trusted", msg)
	}
	if got := wh.clusters(); len(got) != 0 {
		t.Errorf("the webhook reviewed objects of %v over a TLS connection kcp should not have trusted", got)
	}
}
