package spire

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"github.com/spiffe/go-spiffe/v2/workloadapi"
	"google.golang.org/grpc"
	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	"github.com/kcp-dev/tunnel-broker/kcpplugin"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

const (
	trustDomain = "spire.test"
	cluster     = "root"
	// svidTTL is short so that SPIRE rotates every workload's SVID, and the
	// first ones expire, while the test runs. The CA lives 24h.
	svidTTL = 20 * time.Second
	// firstSVID caps the wait for the agent's first entry sync.
	firstSVID = 30 * time.Second
)

// Workloads: each runs as its own system user, and SPIRE tells them apart by
// the unix:user (or unix:uid) selector of its entry.
var (
	brokerID   = id("/ns/kcp-system/sa/tunnel-broker")    // user tunnel-broker
	agentID    = id("/ns/kcp-syncer/sa/syncer-us-east-1") // user tunnel-agent
	kcpID      = id("/ns/kcp/sa/kcp")                     // this test process, uid 0
	strangerID = id("/ns/default/sa/stranger")            // user tunnel-stranger: registered, not in the policy
	// User tunnel-rogue has no entry at all.
)

func id(path string) spiffeid.ID {
	return spiffeid.RequireFromPath(spiffeid.RequireTrustDomainFromString(trustDomain), path)
}

// brokerPolicy binds syncers to their sync target's clusters through the
// template, and lets kcp dial.
func brokerPolicy() policy.File {
	return policy.File{
		Agents:      []policy.AgentRule{{ID: "spiffe://" + trustDomain + "/ns/kcp-syncer/sa/syncer-{syncTarget}"}},
		SyncTargets: map[string][]string{"us-east-1": {cluster}},
		Callers:     []policy.CallerRule{{ID: kcpID.String()}},
	}
}

var (
	brokerServing = regexp.MustCompile(`msg="broker serving" address=\S+ id=(\S+)`)
	agentStarting = regexp.MustCompile(`msg="agent starting" .*id=(\S+)`)
	svidLine      = regexp.MustCompile(`(?m)^svid: (\S+) serial (\d+) expires (\S+)$`)
)

func TestSPIRE(t *testing.T) {
	r := startSPIRERun(t)
	r.startWorkloads(t)

	// (2) kcp's real webhook client reaches the webhook through the tunnel.
	r.conn = brokerConn(t, r.caller, r.brokerAddr)
	r.dialer = kcpplugin.NewDialer(r.conn)
	r.adm = harness.NewAdmission(t, harness.AdmissionOptions{
		Service: harness.WebhookService{Namespace: "default", Name: "webhook", Path: "/admit", Port: 443, CABundle: r.wh.CABundle},
		Wrapper: kcpplugin.AuthInfoResolverWrapper(cluster, r.dialer),
	})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	admit(ctx, t, r.adm, "before rotation")

	// A tunnel that stays open across the rotation.
	longLived, err := r.dialer.DialService(ctx, cluster, "default", "echo", 7)
	if err != nil {
		t.Fatalf("dial echo: %v", err)
	}
	defer longLived.Close()
	r.longLived = longLived
	roundTrip(t, longLived, "before rotation")
	r.noteSVIDsInForce(t)

	// (4) Refusals, while the SVIDs age.
	t.Run("unregistered and unauthorized workloads are refused", r.refusals)
	// (3) SPIRE rotates every SVID, and the ones in force above expire.
	t.Run("rotation keeps tunnels and new dials working", func(t *testing.T) { r.rotation(ctx, t) })
	// Tunnels end with kcp's connection (the webhook client keeps idle
	// ones); then the agent and the broker shut down by themselves.
	longLived.Close()
	r.conn.Close()
	for _, c := range []*harness.Command{r.agent, r.broker} {
		stopping := time.Now()
		if err := c.Stop(); err != nil {
			t.Errorf("%s on SIGTERM: %v", c.Name, err)
		}
		t.Logf("%s stopped in %v", c.Name, time.Since(stopping).Round(time.Millisecond))
	}
	t.Logf("done after %v", time.Since(r.start).Round(time.Millisecond))
}

// spireRun is TestSPIRE's world: SPIRE, the workloads it gives their
// SVIDs to, kcp's side (this process) and what the steps note for later
// ones.
type spireRun struct {
	start  time.Time
	bin    string // the folder of the broker, agent and spiffe-dial binaries
	shared string // a folder every workload's user may read
	s      *harness.SPIRE
	// logs are the processes whose last lines a failed run shows.
	logs []*harness.Command

	caller     *workloadapi.X509Source // kcp's SVIDs
	wh         *harness.Webhook
	services   string // the agent's services file
	broker     *harness.Command
	brokerAddr string
	agent      *harness.Command

	conn      *grpc.ClientConn // kcp's connection to the broker
	dialer    *kcpplugin.Dialer
	adm       *harness.Admission
	longLived net.Conn // a tunnel that stays open across the rotation

	// The SVIDs in force before the rotation.
	callerSVID0  *x509svid.SVID
	brokerCert0  *x509.Certificate
	agentSerial0 string
	agentExpiry0 time.Time
}

// startSPIRERun makes the workloads' system users and shared binaries, and
// starts a SPIRE server and agent with an entry for each workload but the
// rogue. A failed run logs the last lines of every process it started.
func startSPIRERun(t *testing.T) *spireRun {
	if os.Geteuid() != 0 {
		// Not a skip: CI runs as root, and this test must run there.
		t.Fatal("TestSPIRE runs workloads as separate system users (useradd, runuser) and needs root")
	}
	r := &spireRun{start: time.Now()}
	for _, u := range []string{"tunnel-broker", "tunnel-agent", "tunnel-stranger", "tunnel-rogue"} {
		harness.SystemUser(t, u)
	}
	r.shared = harness.SharedDir(t)
	r.bin = harness.SharedBinaries(t, r.shared, "github.com/kcp-dev/tunnel-broker/test/cmd/spiffe-dial")
	t.Logf("users and binaries ready after %v", time.Since(r.start).Round(time.Millisecond))

	r.s = harness.StartSPIRE(t, harness.SPIREOptions{TrustDomain: trustDomain, Entries: []harness.SPIREEntry{
		{SPIFFEID: brokerID, Selectors: []string{"unix:user:tunnel-broker"}, X509SVIDTTL: svidTTL, DNSNames: []string{"localhost"}},
		{SPIFFEID: agentID, Selectors: []string{"unix:user:tunnel-agent"}, X509SVIDTTL: svidTTL},
		{SPIFFEID: kcpID, Selectors: []string{"unix:uid:0"}, X509SVIDTTL: svidTTL},
		{SPIFFEID: strangerID, Selectors: []string{"unix:user:tunnel-stranger"}},
	}})
	r.logs = append(r.logs, r.s.Server, r.s.Agent)
	t.Cleanup(func() {
		if t.Failed() {
			for _, c := range r.logs {
				t.Logf("---- %s (last lines) ----\n%s", c.Name, tail(c.Output(), 40))
			}
		}
	})
	t.Logf("SPIRE server and agent up (agent %s) after %v", r.s.AgentID, time.Since(r.start).Round(time.Millisecond))
	return r
}

// startWorkloads checks that every workload gets its SVID from the
// Workload API (1): this process as kcp, then the broker and the agent,
// each as its own user, in front of a webhook and an echo server.
func (r *spireRun) startWorkloads(t *testing.T) {
	r.s.WaitForSVID(t, kcpID, firstSVID)
	t.Logf("first SVID after %v", time.Since(r.start).Round(time.Millisecond))
	r.caller = r.s.X509Source(t, firstSVID)
	if got := mustSVID(t, r.caller).ID; got != kcpID {
		t.Fatalf("the test process got %s, want %s", got, kcpID)
	}

	r.wh = harness.StartWebhook(t, harness.WebhookOptions{Namespace: "default", Name: "webhook"}, review)
	echo := harness.StartEcho(t)
	policyFile := harness.WriteShared(t, r.shared, "policy.yaml", brokerPolicy())
	r.services = harness.WriteShared(t, r.shared, "services.yaml", lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: cluster, Namespace: "default", Name: "webhook", Ports: map[string]string{"443": r.wh.Addr}},
		{Cluster: cluster, Namespace: "default", Name: "echo", Ports: map[string]string{"7": echo}},
	}})

	brokerW := harness.Workload{Name: "broker", Bin: r.bin, Prefix: harness.AsUser("tunnel-broker"), Socket: r.s.WorkloadAPI}
	// Clients move to new connections, with their current SVIDs, well
	// within half an SVID's life, as the default does for SPIRE's default
	// TTL of an hour.
	r.broker, r.brokerAddr = brokerW.StartBroker(t, policyFile, firstSVID, "--max-connection-age", (svidTTL / 5).String())
	r.logs = append(r.logs, r.broker)
	if got := r.broker.WaitFor(t, brokerServing, time.Second)[1]; got != brokerID.String() {
		t.Fatalf("broker serves as %s, want %s", got, brokerID)
	}
	agentW := harness.Workload{Name: "syncer-agent", Bin: r.bin, Prefix: harness.AsUser("tunnel-agent"), Socket: r.s.WorkloadAPI}
	r.agent = agentW.StartAgent(t, r.brokerAddr, r.services, "--broker-spiffe-id", brokerID.String())
	r.logs = append(r.logs, r.agent)
	if got := r.agent.WaitFor(t, agentStarting, firstSVID)[1]; got != agentID.String() {
		t.Fatalf("agent runs as %s, want %s", got, agentID)
	}
	r.agent.WaitFor(t, harness.AgentRegistered, 20*time.Second)
	t.Logf("broker (%s) and agent (%s) up from the Workload API after %v", brokerID, agentID, time.Since(r.start).Round(time.Millisecond))
}

// noteSVIDsInForce notes the SVIDs in force now: the connections made so
// far were made with these or older ones. The SPIRE agent hands every
// process of a workload the same SVID, so a fetch as the workload's user
// shows the agent's.
func (r *spireRun) noteSVIDsInForce(t *testing.T) {
	r.callerSVID0 = mustSVID(t, r.caller)
	r.brokerCert0 = brokerCert(t, r.caller, r.brokerAddr)
	r.agentSerial0, r.agentExpiry0 = svidOf(t, r.bin, r.s, "tunnel-agent", agentID)
	t.Logf("SVIDs in force after %v: kcp serial %s (expires %s), broker %s, agent %s",
		time.Since(r.start).Round(time.Millisecond), r.callerSVID0.Certificates[0].SerialNumber,
		r.callerSVID0.Certificates[0].NotAfter.Format(time.TimeOnly), r.brokerCert0.SerialNumber, r.agentSerial0)
}

// refusals checks that a workload SPIRE knows but the policy does not is
// refused as a caller and as an agent, and that one SPIRE does not know
// gets no SVID at all.
func (r *spireRun) refusals(t *testing.T) {
	// Registered in SPIRE, so it gets an SVID; not in the policy, so the
	// broker refuses its Dial...
	out, code := run(t, r.bin, "tunnel-stranger", r.s, "--wait", firstSVID.String(),
		"--broker", r.brokerAddr, "--broker-spiffe-id", brokerID.String(), "--service", "echo", "--port", "7")
	if !strings.Contains(out, "svid: "+strangerID.String()+" ") || !strings.Contains(out, "dial-error: PermissionDenied") || code != 3 {
		t.Errorf("unauthorized caller: exit %d, output:\n%s\nwant an SVID for %s, then PermissionDenied", code, out, strangerID)
	}
	t.Logf("tunnel-stranger as caller: %s", oneLine(out))
	// ...and its registration as an agent.
	strangerAgent := harness.Workload{Name: "stranger-agent", Bin: r.bin, Prefix: harness.AsUser("tunnel-stranger"), Socket: r.s.WorkloadAPI}.
		StartAgent(t, r.brokerAddr, r.services)
	r.logs = append(r.logs, strangerAgent)
	refused := strangerAgent.WaitFor(t, regexp.MustCompile(`level=ERROR msg="the broker's policy refuses this agent.*(code = PermissionDenied desc = [^"]*)`), 20*time.Second)
	t.Logf("tunnel-stranger as agent: %s", refused[1])
	r.broker.WaitFor(t, regexp.MustCompile(`permission denied" peer=`+regexp.QuoteMeta(strangerID.String())+` asked=call .* method=/kcp.tunnel.v1.AgentService/Connect`), 5*time.Second)
	if err := strangerAgent.Stop(); err != nil {
		t.Errorf("stranger agent: %v", err)
	}
	if n := strangerAgent.Count(harness.AgentRegistered); n != 0 {
		t.Errorf("an agent outside the policy registered %d times", n)
	}

	// Not registered in SPIRE at all: the Workload API gives it nothing,
	// so it has no identity to present to the broker.
	out, code = run(t, r.bin, "tunnel-rogue", r.s)
	if !strings.Contains(out, "svid-error: PermissionDenied") || code != 2 {
		t.Errorf("unregistered workload: exit %d, output:\n%s\nwant no SVID (PermissionDenied)", code, out)
	}
	t.Logf("tunnel-rogue: %s", oneLine(out))
}

// rotation waits until SPIRE has rotated every SVID and the ones in force
// before have expired, and checks that the tunnel opened with them still
// carries data, that the agent followed its rotation, and that new dials
// and the webhook work on the old connection and on a new one.
func (r *spireRun) rotation(ctx context.Context, t *testing.T) {
	r.waitFirstSVIDsExpired(t)

	// The tunnel opened with the expired SVIDs still carries data.
	roundTrip(t, r.longLived, "after rotation")
	// The agent followed its SVID's rotation: it registered on a new
	// connection with each new SVID, and drained the old registration
	// (the dials below reach it).
	if n := r.agent.Count(harness.AgentRegistered); n < 2 {
		t.Errorf("the agent registered %d times, want once per SVID it held", n)
	}
	// New dials on the first gRPC connection (which the broker has since
	// asked to move to a new one) and on a new one, whose handshakes can
	// only succeed with kcp's new SVID.
	admit(ctx, t, r.adm, "after rotation")
	for name, d := range map[string]*kcpplugin.Dialer{"old connection": r.dialer, "new connection": kcpplugin.NewDialer(brokerConn(t, r.caller, r.brokerAddr))} {
		c, err := d.DialService(ctx, cluster, "default", "echo", 7)
		if err != nil {
			t.Fatalf("dial after rotation on the %s: %v", name, err)
		}
		roundTrip(t, c, "new tunnel after rotation, "+name)
		c.Close()
	}
	t.Log("the tunnel opened before still echoes, the agent is still registered once, new dials and the webhook work")
}

// waitFirstSVIDsExpired waits until kcp's SVID rotated (SPIRE must hand
// out the new one before the old one expires) and then until the SVIDs
// that made the open connections have expired, so that nothing after can
// be using one; it checks that the agent and the broker rotated theirs.
func (r *spireRun) waitFirstSVIDsExpired(t *testing.T) {
	t.Helper()
	callerSVID1 := waitForRotation(t, r.caller, r.callerSVID0.Certificates[0].SerialNumber.String(),
		min(time.Until(r.callerSVID0.Certificates[0].NotAfter), 2*svidTTL))
	t.Logf("kcp's SVID rotated after %v: serial %s", time.Since(r.start).Round(time.Millisecond), callerSVID1.Certificates[0].SerialNumber)

	expiry := latest(r.callerSVID0.Certificates[0].NotAfter, r.brokerCert0.NotAfter, r.agentExpiry0)
	if wait := time.Until(expiry) + time.Second; wait > 0 {
		if wait > 2*svidTTL {
			t.Fatalf("first SVIDs expire at %v, later than their TTL allows", expiry)
		}
		time.Sleep(wait)
	}
	agentSerial, _ := svidOf(t, r.bin, r.s, "tunnel-agent", agentID)
	if agentSerial == r.agentSerial0 {
		t.Errorf("the agent's SVID was not rotated: serial %s", agentSerial)
	}
	brokerCert1 := brokerCert(t, r.caller, r.brokerAddr)
	if brokerCert1.SerialNumber.Cmp(r.brokerCert0.SerialNumber) == 0 {
		t.Errorf("the broker still presents its first SVID (serial %s) to new handshakes", brokerCert1.SerialNumber)
	}
	t.Logf("after %v the SVIDs above have expired; now: kcp %s, broker %s, agent %s",
		time.Since(r.start).Round(time.Millisecond), mustSVID(t, r.caller).Certificates[0].SerialNumber, brokerCert1.SerialNumber, agentSerial)
}

// review allows ConfigMaps unless they ask to be denied.
func review(req *admissionv1.AdmissionRequest, _ string) *admissionv1.AdmissionResponse {
	if strings.Contains(string(req.Object.Raw), `"deny":"yes"`) {
		return &admissionv1.AdmissionResponse{Allowed: false, Result: &metav1.Status{Message: "denied through the tunnel", Code: 403}}
	}
	return &admissionv1.AdmissionResponse{Allowed: true}
}

// admit sends an allowed and a denied ConfigMap through the webhook.
func admit(ctx context.Context, t *testing.T, adm *harness.Admission, when string) {
	t.Helper()
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "cm"}}
	if _, err := adm.Admit(ctx, cm); err != nil {
		t.Fatalf("%s: allowed request: %v", when, err)
	}
	cm.Data = map[string]string{"deny": "yes"}
	if _, err := adm.Admit(ctx, cm); err == nil || !strings.Contains(err.Error(), "denied through the tunnel") {
		t.Fatalf("%s: denied request: got %v, want the webhook's denial", when, err)
	}
}

// brokerConn is kcp's gRPC connection to the broker, with its SVID from
// the Workload API, expecting the broker's SPIFFE ID.
func brokerConn(t *testing.T, src *workloadapi.X509Source, addr string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(identity.ClientCredentials(src, tlsconfig.AuthorizeID(brokerID))))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// brokerCert makes a new mTLS handshake with the broker, as kcp, and
// returns the certificate the broker presented.
func brokerCert(t *testing.T, src *workloadapi.X509Source, addr string) *x509.Certificate {
	t.Helper()
	cfg := tlsconfig.MTLSClientConfig(src, src, tlsconfig.AuthorizeID(brokerID))
	cfg.NextProtos = []string{"h2"} // as gRPC, so the broker does not log a refusal
	conn, err := tls.Dial("tcp", addr, cfg)
	if err != nil {
		t.Fatalf("TLS handshake with the broker: %v", err)
	}
	defer conn.Close()
	return conn.ConnectionState().PeerCertificates[0]
}

func mustSVID(t *testing.T, src *workloadapi.X509Source) *x509svid.SVID {
	t.Helper()
	s, err := src.GetX509SVID()
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// waitForRotation waits until src holds an SVID other than serial.
func waitForRotation(t *testing.T, src *workloadapi.X509Source, serial string, timeout time.Duration) *x509svid.SVID {
	t.Helper()
	deadline := time.After(timeout)
	for {
		if s := mustSVID(t, src); s.Certificates[0].SerialNumber.String() != serial {
			return s
		}
		select {
		case <-src.Updated():
		case <-deadline:
			t.Fatalf("SVID serial %s not rotated within %v", serial, timeout)
		}
	}
}

// run runs spiffe-dial as user against the Workload API and returns its
// output and exit code.
func run(t *testing.T, bin, user string, s *harness.SPIRE, args ...string) (string, int) {
	t.Helper()
	c := harness.StartCommand(t, "spiffe-dial "+user, append(append(harness.AsUser(user),
		bin+"/spiffe-dial", "--socket", s.WorkloadAPI), args...))
	err := c.Wait(t, time.Minute)
	var exit *exec.ExitError
	switch {
	case err == nil:
		return c.Output(), 0
	case errors.As(err, &exit):
		return c.Output(), exit.ExitCode()
	}
	t.Fatalf("spiffe-dial as %s: %v", user, err)
	return "", 0
}

// svidOf fetches the SVID that user's workloads get now, and checks its ID.
func svidOf(t *testing.T, bin string, s *harness.SPIRE, user string, want spiffeid.ID) (serial string, expires time.Time) {
	t.Helper()
	out, code := run(t, bin, user, s, "--wait", firstSVID.String())
	m := svidLine.FindStringSubmatch(out)
	if code != 0 || m == nil {
		t.Fatalf("SVID of user %s: exit %d, output:\n%s", user, code, out)
	}
	if m[1] != want.String() {
		t.Fatalf("user %s got %s, want %s", user, m[1], want)
	}
	expires, err := time.Parse(time.RFC3339, m[3])
	if err != nil {
		t.Fatal(err)
	}
	return m[2], expires
}

// roundTrip writes a line to an echo tunnel and reads it back.
func roundTrip(t *testing.T, conn net.Conn, what string) {
	t.Helper()
	msg := []byte(what + "\n")
	if err := conn.SetDeadline(time.Now().Add(20 * time.Second)); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Write(msg); err != nil {
		t.Fatalf("%s: write: %v", what, err)
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(conn, got); err != nil || string(got) != string(msg) {
		t.Fatalf("%s: read %q, %v", what, got, err)
	}
}

func oneLine(s string) string { return strings.ReplaceAll(strings.TrimSpace(s), "\n", "; ") }

func latest(ts ...time.Time) time.Time {
	var l time.Time
	for _, t := range ts {
		if t.After(l) {
			l = t
		}
	}
	return l
}

func tail(s string, n int) string {
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
