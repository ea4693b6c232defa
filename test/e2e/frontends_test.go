package e2e

import (
	"bufio"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"sigs.k8s.io/yaml"

	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// The broker's two caller front ends, the Dial RPC and the HTTP CONNECT
// front end, admit tunnels one way: a CONNECT tunnel is listed and
// audited as a Dial tunnel is, and both count against one quota per
// caller.

// egressCallerPolicy writes the default policy with an egress rule for
// /kcp, to cluster root: the one identity may both Dial and CONNECT.
func egressCallerPolicy(t *testing.T, env *harness.Env) string {
	t.Helper()
	f := harness.DefaultPolicy()
	f.Egress = append(f.Egress, policy.EgressRule{ID: harness.ID("/kcp").String(), Cluster: "root"})
	raw, err := yaml.Marshal(f)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(env.Dir, "policy-egress-caller.yaml")
	if err := os.WriteFile(path, raw, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// startFrontEnds runs the broker binary with the CONNECT front end on TCP
// with mTLS (--egress-listen), a policy that lets /kcp use both front ends,
// and extra; and an agent that serves echo in root. It returns the broker,
// its gRPC address and its CONNECT front end's.
func startFrontEnds(t *testing.T, env *harness.Env, extra ...string) (*harness.Process, string, string) {
	t.Helper()
	args := append([]string{"--log-json", "--id", "broker-a", "--policy", egressCallerPolicy(t, env), "--egress-listen", "127.0.0.1:0"}, extra...)
	broker, addr := env.StartBrokerProcess(args...)
	line := broker.WaitLogged(t, 1, `"msg":"egress front end serving"`, `"frontend":"tls"`)[0]
	var serving struct{ Address string }
	if err := json.Unmarshal([]byte(line), &serving); err != nil || serving.Address == "" {
		t.Fatalf("the CONNECT front end's address in %s: %v", line, err)
	}
	env.StartAgentProcess(addr, "/agent/sync-target-1", echoServices(harness.StartEcho(t)))
	return broker, addr, serving.Address
}

// connectConn is a tunnel through the CONNECT front end; Read reads what
// the answer's reader holds first.
type connectConn struct {
	net.Conn
	r *bufio.Reader
}

func (c *connectConn) Read(b []byte) (int, error) { return c.r.Read(b) }

// connect sends CONNECT authority to the front end at addr over mTLS as
// the identity path, and returns the answer's status code and, for a 200,
// the tunnel (else the answer's body).
func connect(t *testing.T, env *harness.Env, addr, path, authority string) (int, net.Conn, string) {
	t.Helper()
	code, conn, body, err := tryConnect(env, addr, path, authority)
	if err != nil {
		t.Fatal(err)
	}
	if conn != nil {
		t.Cleanup(func() { conn.Close() })
	}
	return code, conn, body
}

// tryConnect is connect, which says what failed instead of failing the
// test; the caller closes the tunnel.
func tryConnect(env *harness.Env, addr, path, authority string) (int, net.Conn, string, error) {
	src := env.Identity(path)
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 30 * time.Second}, "tcp", addr,
		tlsconfig.MTLSClientConfig(src, src, tlsconfig.AuthorizeID(harness.ID("/broker"))))
	if err != nil {
		return 0, nil, "", fmt.Errorf("CONNECT front end: %w", err)
	}
	_ = conn.SetDeadline(time.Now().Add(30 * time.Second))
	if _, err := fmt.Fprintf(conn, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", authority, authority); err != nil {
		conn.Close()
		return 0, nil, "", fmt.Errorf("CONNECT %s: %w", authority, err)
	}
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil {
		conn.Close()
		return 0, nil, "", fmt.Errorf("CONNECT %s: reading the answer: %w", authority, err)
	}
	if resp.StatusCode != http.StatusOK {
		var body strings.Builder
		_, _ = bufio.NewReader(resp.Body).WriteTo(&body)
		conn.Close()
		return resp.StatusCode, nil, strings.TrimSpace(body.String()), nil
	}
	_ = conn.SetDeadline(time.Time{})
	return resp.StatusCode, &connectConn{Conn: conn, r: br}, "", nil
}

// mustConnect is connect to echo in root, which must answer 200.
func mustConnect(t *testing.T, env *harness.Env, addr string) net.Conn {
	t.Helper()
	code, conn, body := connect(t, env, addr, "/kcp", "echo.default.svc:80")
	if code != http.StatusOK {
		t.Fatalf("CONNECT echo.default.svc:80: %d %s", code, body)
	}
	return conn
}

func TestConnectTunnelsAreListedAndAuditedAsDialTunnelsAre(t *testing.T) {
	env := harness.NewEnv(t)
	broker, addr, egress := startFrontEnds(t, env)
	conn := mustConnect(t, env, egress)
	roundTrip(t, conn, "through CONNECT") // 16 bytes each way

	// While it is open, an operator sees it.
	out, err := tunnelctl(t, env, addr, "/operator", "tunnels").CombinedOutput()
	if err != nil {
		t.Fatalf("tunnelctl tunnels: %v\n%s", err, out)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if len(lines) != 3 || lines[0] != "broker replica broker-a: 1 tunnel" {
		t.Fatalf("tunnelctl tunnels, one CONNECT tunnel open, printed:\n%s", out)
	}
	// TUNNEL CALLER TARGET AGENT AGE UP DOWN IDLE
	if f := strings.Fields(lines[2]); len(f) != 8 || f[1] != "spiffe://tunnel.test/kcp" || f[2] != "root/default/echo:80" ||
		f[3] != "sync-target-1" || f[5] != "16" || f[6] != "16" {
		t.Errorf("tunnel line %q, want kcp's CONNECT tunnel to root/default/echo:80 through sync-target-1, 16 bytes each way", lines[2])
	}

	// Once it ends, it has one audit line.
	conn.Close()
	audits := broker.WaitLogged(t, 1, `"msg":"tunnel audit"`)
	var got auditLine
	if err := json.Unmarshal([]byte(audits[0]), &got); err != nil {
		t.Fatalf("audit line %s: %v", audits[0], err)
	}
	a := got.Audit
	if got.Level != "INFO" || a.Caller != "spiffe://tunnel.test/kcp" || a.Cluster != "root" || a.Namespace != "default" ||
		a.Service != "echo" || a.Port != 80 || a.Agent != "sync-target-1" || a.Broker != "broker-a" ||
		a.BytesUp != 16 || a.BytesDown != 16 || len(a.Tunnel) != 16 {
		t.Errorf("audit line of the CONNECT tunnel: %s", audits[0])
	}
	if f := strings.Fields(lines[2]); len(f) > 0 && f[0] != a.Tunnel {
		t.Errorf("the audit line names tunnel %s, the listing %s", a.Tunnel, f[0])
	}
	if len(audits) != 1 {
		t.Errorf("%d audit lines for one tunnel:\n%s", len(audits), strings.Join(audits, "\n"))
	}
	t.Logf("the CONNECT tunnel ended with %s", a.Code)
}

func TestDialAndConnectTunnelsShareOneQuotaPerCaller(t *testing.T) {
	env := harness.NewEnv(t)
	broker, addr, egress := startFrontEnds(t, env, "--max-tunnels-per-caller", "2")
	kcp := env.Dialer(addr, "/kcp")

	// One tunnel of each kind: the caller holds 2.
	dialed, err := dialEchoConn(kcp)
	if err != nil {
		t.Fatalf("a Dial tunnel: %v", err)
	}
	defer dialed.Close()
	roundTrip(t, dialed, "through Dial")
	connected := mustConnect(t, env, egress)
	roundTrip(t, connected, "through CONNECT")

	// A third of either kind is refused.
	_, err = dialEchoConn(kcp)
	if status.Code(err) != codes.ResourceExhausted {
		t.Errorf("a third tunnel, by Dial: %v, want ResourceExhausted", err)
	} else {
		t.Logf("a third tunnel, by Dial: %v", err)
	}
	if code, conn, body := connect(t, env, egress, "/kcp", "echo.default.svc:80"); code != http.StatusTooManyRequests {
		if conn != nil {
			conn.Close()
		}
		t.Errorf("a third tunnel, by CONNECT: %d %s, want 429", code, body)
	} else {
		t.Logf("a third tunnel, by CONNECT: %d %s", code, body)
	}
	if n, _ := scrape(t, broker, `kcp_tunnel_broker_limits_hit_total{limit="tunnels_per_caller"}`); n != 2 {
		t.Errorf("the broker counted %v refusals for tunnels_per_caller, want 2 (one Dial, one CONNECT)", n)
	}
	if n, ok := scrape(t, broker, `kcp_tunnel_broker_limits_hit_total{limit="egress_tunnels_per_caller"}`); ok {
		t.Errorf("the broker counted %v refusals under egress_tunnels_per_caller, a limit of its own", n)
	}

	// The CONNECT tunnel's end frees its place for a Dial, and the Dial
	// tunnel's for a CONNECT.
	connected.Close()
	var again net.Conn
	harness.Eventually(t, 20*time.Second, "a Dial once the CONNECT tunnel ended", func() bool {
		again, err = dialEchoConn(kcp)
		return err == nil
	})
	defer again.Close()
	roundTrip(t, again, "through Dial, in the CONNECT tunnel's place")
	dialed.Close()
	harness.Eventually(t, 20*time.Second, "a CONNECT once the first Dial tunnel ended", func() bool {
		code, conn, _ := connect(t, env, egress, "/kcp", "echo.default.svc:80")
		if conn != nil {
			roundTrip(t, conn, "through CONNECT, in the Dial tunnel's place")
		}
		return code == http.StatusOK
	})
}
