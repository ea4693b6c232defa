package deploy

import (
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/kcp-dev/tunnel-broker/internal/release"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// TestDeployHelmTestListsAgentsAsAnOperator: with tests.enabled, the
// broker chart's helm test is a pod that runs make images' tunnelctl,
// `agents`, against the callers' Service, with an identity of its own
// (SPIRE: a ClusterSPIFFEID for its ServiceAccount, which no Service and no
// other ClusterSPIFFEID selects; secret: tests.svidSecret) that the
// NetworkPolicy admits. Its command, pointed at a real broker with an
// operator's SVID in place of the mounted one, lists the agents.
func TestDeployHelmTestListsAgentsAsAnOperator(t *testing.T) {
	for _, c := range []struct {
		name string
		set  []string
	}{
		{"spire", []string{"--set", "tests.enabled=true"}},
		{"secret", []string{"-f", filepath.Join(chartDir("tunnel-broker"), "ci", "production-values.yaml"),
			"--set", "svid.source=secret", "--set", "svid.secret.name=broker-svid",
			"--set", "tests.enabled=true", "--set", "tests.svidSecret=operator-svid"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			objs := templateChart(t, "tunnel-broker", append(brokerPolicyArgs(), c.set...)...)
			pod := theTestPod(t, objs)
			tc := container(pod.Spec, "tunnelctl")
			if tc == nil {
				t.Fatal("no tunnelctl container in the test pod")
			}
			if want := release.Tunnelctl.Name + ":" + harness.Version(t); tc.Image != want {
				t.Errorf("the test runs %s, want %s (make images)", tc.Image, want)
			}
			if n := len(tc.Args); n == 0 || tc.Args[n-1] != "agents" {
				t.Fatalf("the test's arguments %v do not end with the command agents", tc.Args)
			}
			flags := flagsOf(tc.Args[:len(tc.Args)-1])
			checkFlagsExist(t, "tunnelctl", flags)
			if want := "tunnel-broker.kcp-system.svc:8443"; flags["broker"] != want {
				t.Errorf("the test dials --broker %q, want the callers' Service %s", flags["broker"], want)
			}
			for _, s := range ofKind(objs, "Service") {
				var svc corev1.Service
				s.into(t, &svc)
				if labels.SelectorFromSet(svc.Spec.Selector).Matches(labels.Set(pod.Labels)) {
					t.Errorf("Service %s selects the test pod", svc.Name)
				}
			}
			d := appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Name: pod.Name, Namespace: pod.Namespace}}
			d.Spec.Template = corev1.PodTemplateSpec{ObjectMeta: pod.ObjectMeta, Spec: pod.Spec}
			checkIdentitySource(t, pod.Spec, tc, flags)
			id, ok := spiffeIDOf(t, objs, &d)
			switch c.name {
			case "spire":
				if want := "spiffe://" + trustDomain + "/ns/kcp-system/sa/tunnel-broker-test"; !ok || id.String() != want {
					t.Errorf("the test pod's ClusterSPIFFEID gives it %v (found: %v), want %s", id, ok, want)
				}
			case "secret":
				if ok {
					t.Errorf("a ClusterSPIFFEID selects the test pod (%s) with SVIDs from a Secret", id)
				}
				checkAdmitted(t, objs, pod)
			}

			// The same command against a real broker, as the harness's
			// operator: the mounted files are the operator's SVID files.
			env := harness.NewEnv(t)
			_, addr := env.StartBrokerProcess()
			op := env.SVID("/operator")
			args := []string{"--broker", addr}
			if c.name == "spire" {
				args = append(args, "--svid-cert", op.Cert, "--svid-key", op.Key, "--trust-bundle", op.Bundle)
			} else {
				for _, f := range []string{"svid-cert", "svid-key", "trust-bundle"} {
					file := map[string]string{"tls.crt": op.Cert, "tls.key": op.Key, "ca.crt": op.Bundle}[filepath.Base(flags[f])]
					if file == "" {
						t.Fatalf("--%s %s is not one of the Secret's keys", f, flags[f])
					}
					args = append(args, "--"+f, file)
				}
			}
			out, err := exec.Command(filepath.Join(harness.Binaries(t), "tunnelctl"), append(args, "agents")...).CombinedOutput()
			if err != nil || !strings.Contains(string(out), "broker replica ") {
				t.Errorf("tunnelctl %s agents: %v\n%s", strings.Join(args, " "), err, out)
			}
		})
	}
}

// theTestPod is the one helm test hook the chart renders.
func theTestPod(t *testing.T, objs []object) corev1.Pod {
	t.Helper()
	var tests []corev1.Pod
	for _, o := range ofKind(objs, "Pod") {
		var p corev1.Pod
		o.into(t, &p)
		if p.Annotations["helm.sh/hook"] == "test" {
			tests = append(tests, p)
		}
	}
	if len(tests) != 1 {
		t.Fatalf("%d helm test pods rendered, want 1", len(tests))
	}
	return tests[0]
}

// checkAdmitted: the broker's NetworkPolicy, where it names the gRPC
// port's sources, admits pod.
func checkAdmitted(t *testing.T, objs []object, pod corev1.Pod) {
	t.Helper()
	for _, o := range ofKind(objs, "NetworkPolicy") {
		var np networkingv1.NetworkPolicy
		o.into(t, &np)
		for _, rule := range np.Spec.Ingress {
			if len(rule.Ports) == 0 || rule.Ports[0].Port == nil || rule.Ports[0].Port.String() != "grpc" || len(rule.From) == 0 {
				continue
			}
			admitted := false
			for _, from := range rule.From {
				if from.PodSelector == nil || from.NamespaceSelector != nil {
					continue
				}
				if s, err := metav1.LabelSelectorAsSelector(from.PodSelector); err == nil && s.Matches(labels.Set(pod.Labels)) {
					admitted = true
				}
			}
			if !admitted {
				t.Errorf("NetworkPolicy %s does not admit the test pod to the gRPC port", o.Name)
			}
		}
	}
}
