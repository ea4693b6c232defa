package deploy

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"

	"github.com/kcp-dev/tunnel-broker/broker/policy"
)

// withoutSPIRE is the section of deploy/README.md whose commands
// TestDeployHelmWithoutSPIRE runs.
const withoutSPIRE = "### Without SPIRE"

// devNamespace is the namespace those commands install into.
const devNamespace = "tunnel-dev"

// TestDeployHelmWithoutSPIRE runs the commands of deploy/README.md's
// "Without SPIRE" that make the installation (tunnelctl dev-ca, the
// Secrets, helm install of both charts with their dev-values.yaml) as
// written, against the Deploy tests' kube-apiserver, then checks what they
// made: both releases deployed; each Deployment reads its SVID from a
// Secret that exists and holds tls.crt, tls.key and ca.crt; the broker's
// policy, as installed, lets the agent's identity (from its Secret) serve
// the agent's --plain-cluster and the operator's dial and administer; the
// agent expects the broker's identity (from the broker's Secret) and
// resolves the broker's headless Service; both trust the same CA. (The API server runs no pods: the rest of the section
// needs a real cluster.)
func TestDeployHelmWithoutSPIRE(t *testing.T) {
	kc := kube(t)
	raw, err := os.ReadFile(filepath.Join(deployDir(), "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	block := sectionBlock(t, string(raw), withoutSPIRE, "tunnelctl dev-ca")

	// A folder like the repository's top: deploy/, and bin/ with tunnelctl;
	// kubectl and helm on the PATH, with the test's kubeconfig.
	dir := t.TempDir()
	bin := filepath.Join(dir, "bin")
	tools := filepath.Join(dir, "tools")
	for _, d := range []string{bin, tools} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	links := map[string]string{
		filepath.Join(dir, "deploy"):    deployDir(),
		filepath.Join(bin, "tunnelctl"): filepath.Join(os.Getenv("TUNNEL_BIN_DIR"), "tunnelctl"),
		filepath.Join(tools, "kubectl"): kubectl(t),
		filepath.Join(tools, "helm"):    helmBinary(t),
	}
	for link, target := range links {
		if err := os.Symlink(target, link); err != nil {
			t.Fatal(err)
		}
	}
	// The folder the README's "Run it by hand" left, whose first step
	// writes dev/: a reader who tried that first follows this section in
	// the same folder.
	if out, err := exec.Command(filepath.Join(bin, "tunnelctl"), "dev-ca", filepath.Join(dir, "dev")).CombinedOutput(); err != nil {
		t.Fatalf("tunnelctl dev-ca dev, as the README runs it: %v\n%s", err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", "-c", "set -euo pipefail\n"+block)
	cmd.Dir = dir
	cmd.Env = append(helmEnv(t, kc), "PATH="+tools+string(os.PathListSeparator)+os.Getenv("PATH"),
		"KUBECACHEDIR="+filepath.Join(dir, "kubecache"))
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("the commands of %q failed: %v\n%s\n%s", withoutSPIRE, err, block, out)
	}
	t.Logf("%s", out)
	for _, release := range []string{"tunnel-broker", "tunnel-agent"} {
		if !regexp.MustCompile(`(?m)^NAME: ` + release + `\n(.*\n)*?STATUS: deployed$`).Match(out) {
			t.Errorf("helm did not report release %s deployed", release)
		}
	}

	broker := installedDeployment(t, "tunnel-broker")
	agent := installedDeployment(t, "tunnel-agent")
	brokerSVID, brokerCA := svidOf(t, broker, "broker")
	agentSVID, agentCA := svidOf(t, agent, "syncer-agent")
	if brokerCA != agentCA {
		t.Error("the broker's and the agent's Secrets hold different trust bundles")
	}

	var cm corev1.ConfigMap
	if err := json.Unmarshal([]byte(mustKubectl(t, nil, "-n", devNamespace, "get", "configmap", "tunnel-broker-policy", "-o", "json")), &cm); err != nil {
		t.Fatal(err)
	}
	pol, err := policy.Parse([]byte(cm.Data["policy.yaml"]))
	if err != nil {
		t.Fatalf("the installed policy: %v", err)
	}
	agentFlags := flagsOf(container(agent.Spec.Template.Spec, "syncer-agent").Args)
	cluster := agentFlags["plain-cluster"]
	if !pol.IsAgent(agentSVID) || pol.MayServe(agentSVID, []string{cluster}) != nil {
		t.Errorf("the installed policy does not let the agent's identity %s serve --plain-cluster %s", agentSVID, cluster)
	}
	if want := agentFlags["broker-spiffe-id"]; want != brokerSVID.String() {
		t.Errorf("the agent expects --broker-spiffe-id %q, but the broker's Secret holds %s", want, brokerSVID)
	}
	var headless []string
	var services corev1.ServiceList
	if err := json.Unmarshal([]byte(mustKubectl(t, nil, "-n", devNamespace, "get", "services", "-o", "json")), &services); err != nil {
		t.Fatal(err)
	}
	for _, s := range services.Items {
		if s.Spec.ClusterIP == corev1.ClusterIPNone && len(s.Spec.Ports) > 0 {
			headless = append(headless, fmt.Sprintf("%s.%s.svc:%d", s.Name, s.Namespace, s.Spec.Ports[0].Port))
		}
	}
	if !slices.Contains(headless, agentFlags["broker-dns"]) {
		t.Errorf("the agent's --broker-dns %q is not the broker's headless Service (%v)", agentFlags["broker-dns"], headless)
	}
	operator, err := x509svid.Load(filepath.Join(dir, "dev-cluster", "operator", "tls.crt"), filepath.Join(dir, "dev-cluster", "operator", "tls.key"))
	if err != nil {
		t.Fatal(err)
	}
	if !pol.IsOperator(operator.ID) || pol.MayDial(operator.ID, cluster) != nil {
		t.Errorf("the installed policy does not let the operator %s administer and dial %s (the section's tunnelctl commands)", operator.ID, cluster)
	}
}

// sectionBlock returns the ```sh block of the markdown section named
// heading that contains marker.
func sectionBlock(t *testing.T, markdown, heading, marker string) string {
	t.Helper()
	start := strings.Index(markdown, "\n"+heading+"\n")
	if start < 0 {
		t.Fatalf("no section %q", heading)
	}
	body := markdown[start+len(heading)+2:]
	if end := regexp.MustCompile(`\n##+ `).FindStringIndex(body); end != nil {
		body = body[:end[0]]
	}
	for _, b := range regexp.MustCompile("(?s)```sh\n(.*?)```").FindAllStringSubmatch(body, -1) {
		if strings.Contains(b[1], marker) {
			return b[1]
		}
	}
	t.Fatalf("section %q has no sh block with %q", heading, marker)
	return ""
}

func installedDeployment(t *testing.T, name string) *appsv1.Deployment {
	t.Helper()
	var d appsv1.Deployment
	if err := json.Unmarshal([]byte(mustKubectl(t, nil, "-n", devNamespace, "get", "deployment", name, "-o", "json")), &d); err != nil {
		t.Fatal(err)
	}
	return &d
}

// svidOf reads the SVID a container of an installed Deployment is given:
// the Secret its --svid-cert comes from must exist and hold the three
// files; it returns the SVID's ID and the trust bundle.
func svidOf(t *testing.T, d *appsv1.Deployment, name string) (spiffeid.ID, string) {
	t.Helper()
	c := container(d.Spec.Template.Spec, name)
	if c == nil {
		t.Fatalf("%s has no container %s", d.Name, name)
	}
	flags := flagsOf(c.Args)
	checkSVIDSecret(t, d.Spec.Template.Spec, c, flags)
	var secretName string
	for _, m := range c.VolumeMounts {
		if filepath.Clean(m.MountPath) != filepath.Dir(flags["svid-cert"]) {
			continue
		}
		for _, v := range d.Spec.Template.Spec.Volumes {
			if v.Name == m.Name && v.Secret != nil {
				secretName = v.Secret.SecretName
			}
		}
	}
	if secretName == "" {
		t.Fatalf("%s: --svid-cert %s is in no Secret volume", d.Name, flags["svid-cert"])
	}
	var s corev1.Secret
	out, stderr, err := clusterKubectl(t, nil, "-n", d.Namespace, "get", "secret", secretName, "-o", "json")
	if err != nil {
		t.Fatalf("%s reads its SVID from Secret %s, which is not there: %v\n%s", d.Name, secretName, err, stderr)
	}
	if err := json.Unmarshal([]byte(out), &s); err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"tls.crt", "tls.key", "ca.crt"} {
		if len(s.Data[key]) == 0 {
			t.Fatalf("Secret %s has no %s", secretName, key)
		}
	}
	svid, err := x509svid.Parse(s.Data["tls.crt"], s.Data["tls.key"])
	if err != nil {
		t.Fatalf("Secret %s: %v", secretName, err)
	}
	t.Logf("%s: SVID %s from Secret %s", d.Name, svid.ID, secretName)
	return svid.ID, string(s.Data["ca.crt"])
}
