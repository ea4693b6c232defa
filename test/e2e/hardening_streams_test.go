package e2e

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// These tests play hostile peers with valid SVIDs against the broker binary:
// streams that never finish their first message, too many of them, first
// messages that are not protobuf, too many registrations, names that are
// not labels. Each checks the status the broker ends such a stream with.

const (
	dialMethod        = "/kcp.tunnel.v1.DialService/Dial"
	tunnelMethod      = "/kcp.tunnel.v1.AgentService/Tunnel"
	connectMethod     = "/kcp.tunnel.v1.AgentService/Connect"
	healthCheckMethod = "/grpc.health.v1.Health/Check"
	agentID           = "/agent/sync-target-1"
)

// ended waits for the broker to end s and returns its status.
func ended(t *testing.T, s *harness.RawStream) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	st, err := s.Wait(ctx)
	if err != nil {
		t.Fatalf("the broker did not end the stream: %v", err)
	}
	return st.Err()
}

func open(t *testing.T, c *harness.RawConn, method string) *harness.RawStream {
	t.Helper()
	s, err := c.Open(method)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func write(t *testing.T, s *harness.RawStream, b []byte, frame int) {
	t.Helper()
	if err := s.Write(t.Context(), b, frame); err != nil {
		t.Fatal(err)
	}
}

// mostOf is the prefix of a message of n bytes and all of it but its last
// byte: a message that never ends.
func mostOf(n int) []byte {
	return append(harness.GRPCPrefix(n), make([]byte, n-1)...)
}

func TestHardeningStreamsThatNeverSendTheirFirstMessageEnd(t *testing.T) {
	env := harness.NewEnv(t)
	broker, addr := env.StartBrokerProcess("--dial-timeout", "1s")
	kcp := env.RawConn(addr, "/kcp")
	agent := env.RawConn(addr, agentID)

	silent := open(t, kcp, dialMethod)
	most := open(t, kcp, dialMethod)
	write(t, most, mostOf(32<<10), 16384)
	// In 1-byte frames, the costliest for the broker to hold, on a
	// connection of its own: the broker closes that connection (package
	// fragments), and the peer's other connections go on.
	fragmented := env.RawConn(addr, "/kcp")
	tiny := open(t, fragmented, dialMethod)
	// The write may fail: the broker closes the connection on the way.
	_ = tiny.Write(t.Context(), mostOf(4<<10), 1)
	tunnel := open(t, agent, tunnelMethod)
	write(t, tunnel, mostOf(32<<10), 16384)
	connect := open(t, agent, connectMethod)
	write(t, connect, mostOf(32<<10), 16384)
	unary := open(t, kcp, healthCheckMethod)
	write(t, unary, mostOf(1<<10), 16384)

	for _, s := range []*harness.RawStream{silent, most} {
		testutil.CheckStatus(t, "Dial", ended(t, s), codes.DeadlineExceeded, "no target within 1s")
	}
	testutil.CheckStatus(t, "Dial in 1-byte frames", ended(t, tiny), codes.Unavailable, "GOAWAY ENHANCE_YOUR_CALM: fragmented data")
	testutil.CheckStatus(t, "Tunnel", ended(t, tunnel), codes.DeadlineExceeded, "no open within 1s")
	testutil.CheckStatus(t, "Connect", ended(t, connect), codes.DeadlineExceeded, "no register within 1s")
	testutil.CheckStatus(t, "health Check", ended(t, unary), codes.DeadlineExceeded, "deadline exceeded")
	if v, _ := scrape(t, broker, `kcp_tunnel_broker_connections_closed_total{reason="fragmented_data"}`); v != 1 {
		t.Errorf("connections closed for fragmented data: %v, want 1", v)
	}
}

func TestHardeningAPeerThatSendsDataInFragmentsLosesOnlyThatConnection(t *testing.T) {
	env := harness.NewEnv(t)
	broker, addr := env.StartBrokerProcess()
	echo := harness.StartEcho(t)
	env.StartAgentProcess(addr, agentID, lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: "root", Namespace: "default", Name: "echo", Ports: map[string]string{"80": echo}}}})
	d := env.Dialer(addr, "/kcp")
	conn, err := dialEchoConn(d)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	roundTrip(t, conn, "before")

	// The agent's identity, on a connection of its own, sends a whole
	// message in 1-byte frames.
	hostile := env.RawConn(addr, agentID)
	s := open(t, hostile, tunnelMethod)
	_ = s.Write(t.Context(), harness.GRPCMessage(make([]byte, 2000)), 1)
	testutil.CheckStatus(t, "Tunnel in 1-byte frames", ended(t, s), codes.Unavailable, "GOAWAY ENHANCE_YOUR_CALM: fragmented data")
	if v, _ := scrape(t, broker, `kcp_tunnel_broker_connections_closed_total{reason="fragmented_data"}`); v != 1 {
		t.Errorf("connections closed for fragmented data: %v, want 1", v)
	}

	// The agent's own connection, its tunnel and its registration go on.
	roundTrip(t, conn, "after")
	again, err := dialEchoConn(d)
	if err != nil {
		t.Fatalf("dialing after: %v", err)
	}
	defer again.Close()
	roundTrip(t, again, "a new tunnel")
}

func TestHardeningStreamsWaitingForTheirFirstMessageAreBounded(t *testing.T) {
	env := harness.NewEnv(t)
	_, addr := env.StartBrokerProcess("--dial-timeout", "1m",
		"--max-opening-streams-per-peer", "4", "--max-opening-streams", "6")
	kcp := env.RawConn(addr, "/kcp")
	agent := env.RawConn(addr, agentID)

	// Past 4 streams of one peer, the next is refused at once.
	var dials []*harness.RawStream
	for range 5 {
		dials = append(dials, open(t, kcp, dialMethod))
	}
	refused := waitForOneEnd(t, dials)
	testutil.CheckStatus(t, "fifth Dial", refused, codes.ResourceExhausted,
		"spiffe://tunnel.test/kcp has 4 streams open that have not sent their first message, the most a peer may")
	// Past 6 in all, the next is refused whoever opens it.
	tunnels := []*harness.RawStream{open(t, agent, tunnelMethod), open(t, agent, tunnelMethod), open(t, agent, tunnelMethod)}
	testutil.CheckStatus(t, "third Tunnel", waitForOneEnd(t, tunnels), codes.ResourceExhausted,
		"the broker has 6 streams open that have not sent their first message")

	// A stream its peer gives up stops counting.
	for _, s := range dials {
		_ = s.Reset()
	}
	for _, s := range tunnels {
		_ = s.Reset()
	}
	d := env.Dialer(addr, "/kcp")
	harness.Eventually(t, 20*time.Second, "a dial to pass the bound", func() bool {
		_, err := dialEchoConn(d)
		return status.Code(err) == codes.Unavailable // no agent serves root: past the bound
	})
}

// waitForOneEnd waits until one of streams ends, checks that the others go
// on, and returns its status.
func waitForOneEnd(t *testing.T, streams []*harness.RawStream) error {
	t.Helper()
	deadline := time.After(30 * time.Second)
	for {
		for _, s := range streams {
			select {
			case <-s.Ended():
				time.Sleep(100 * time.Millisecond)
				for _, other := range streams {
					if other != s && isEnded(other) {
						t.Errorf("another stream ended too: %v", other.Status().Err())
					}
				}
				return s.Status().Err()
			default:
			}
		}
		select {
		case <-deadline:
			t.Fatal("no stream was refused")
		case <-time.After(10 * time.Millisecond):
		}
	}
}

func isEnded(s *harness.RawStream) bool {
	select {
	case <-s.Ended():
		return true
	default:
		return false
	}
}

func TestHardeningDialsWithoutATargetCountAgainstTheCallersTunnels(t *testing.T) {
	env := harness.NewEnv(t)
	_, addr := env.StartBrokerProcess("--dial-timeout", "1m", "--max-tunnels-per-caller", "3")
	kcp := env.RawConn(addr, "/kcp")
	for range 3 {
		open(t, kcp, dialMethod)
	}
	d := env.Dialer(addr, "/kcp")
	var err error
	harness.Eventually(t, 20*time.Second, "a dial to be refused", func() bool {
		_, err = dialEchoConn(d)
		return status.Code(err) == codes.ResourceExhausted
	})
	testutil.CheckStatus(t, "dial", err, codes.ResourceExhausted, "spiffe://tunnel.test/kcp already holds 3 tunnels")
}

func TestHardeningFirstMessagesThatAreNotProtobufAreInvalidArgument(t *testing.T) {
	env := harness.NewEnv(t)
	_, addr := env.StartBrokerProcess()
	kcp := env.RawConn(addr, "/kcp")
	agent := env.RawConn(addr, agentID)
	notProtobuf := harness.GRPCMessage([]byte{0x0a, 0x05, 'x'}) // field 1 announces 5 bytes, 1 follows
	for _, tc := range []struct {
		conn           *harness.RawConn
		method, saying string
	}{
		{kcp, dialMethod, "not a DialRequest"},
		{agent, tunnelMethod, "not a TunnelRequest"},
		{agent, connectMethod, "not a ConnectRequest"},
	} {
		s := open(t, tc.conn, tc.method)
		write(t, s, notProtobuf, 16384)
		testutil.CheckStatus(t, tc.method, ended(t, s), codes.InvalidArgument, tc.saying)
	}
}

func TestHardeningRegistrationsPerAgentAreBounded(t *testing.T) {
	env := harness.NewEnv(t)
	_, addr := env.StartBrokerProcess("--max-registrations-per-agent", "2")
	client := tunnelv1.NewAgentServiceClient(env.BrokerConn(addr, agentID))
	connect := func() error {
		stream, err := client.Connect(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if err := stream.Send(&tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Register{Register: &tunnelv1.Register{Clusters: []string{"root"}}}}); err != nil {
			t.Fatal(err)
		}
		_, err = stream.Recv()
		return err
	}
	for i := range 2 {
		if err := connect(); err != nil {
			t.Fatalf("registration %d: %v", i+1, err)
		}
	}
	testutil.CheckStatus(t, "third registration", connect(), codes.ResourceExhausted,
		"spiffe://tunnel.test/agent/sync-target-1 already holds 2 registrations with this broker replica, the most an agent may")
}

func TestHardeningAgentNamesAreLabelsAndTheirSeriesGoWithThem(t *testing.T) {
	env := harness.NewEnv(t)
	broker, addr := env.StartBrokerProcess("--probe-interval", "200ms")
	client := tunnelv1.NewAgentServiceClient(env.BrokerConn(addr, agentID))
	for _, name := range []string{"Not_A_Label", strings.Repeat("n", 16<<10)} {
		stream, err := client.Connect(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if err := stream.Send(&tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Register{Register: &tunnelv1.Register{
			Clusters: []string{"root"}, AgentName: name}}}); err != nil {
			t.Fatal(err)
		}
		_, err = stream.Recv()
		testutil.CheckStatus(t, "register", err, codes.InvalidArgument, "is not a DNS-1123 label")
	}

	// The agent refuses such a name before it connects.
	f := env.SVID(agentID)
	out, err := exec.Command(filepath.Join(harness.Binaries(t), "syncer-agent"), "--broker", addr, "--name", "Not_A_Label",
		"--svid-cert", f.Cert, "--svid-key", f.Key, "--trust-bundle", f.Bundle).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "--name") {
		t.Errorf("syncer-agent --name Not_A_Label: %v, %s; want it to refuse the name", err, out)
	}

	// A registration's series live as long as it does.
	reachable := fmt.Sprintf(`kcp_tunnel_broker_agent_reachable{agent="sync-target-1",spiffe_id="spiffe://tunnel.test%s"}`, agentID)
	agent := env.StartAgentProcess(addr, agentID, lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: "root", Namespace: "default", Name: "echo", Ports: map[string]string{"80": "127.0.0.1:1"}}}})
	harness.Eventually(t, 20*time.Second, "the agent's series", func() bool {
		v, ok := scrape(t, broker, reachable)
		return ok && v == 1
	})
	if err := agent.Stop(); err != nil {
		t.Fatal(err)
	}
	harness.Eventually(t, 20*time.Second, "the agent's series to be deleted", func() bool {
		_, ok := scrape(t, broker, reachable)
		return !ok
	})
}

func TestHardeningAnAgentWithThousandsOfClustersRegisters(t *testing.T) {
	env := harness.NewEnv(t)
	// Set as the default is, so that the test means the same on any
	// version of the broker.
	_, addr := env.StartBrokerProcess("--max-message-size", "32768")
	echo := harness.StartEcho(t)
	var services lookup.StaticFile
	const clusters = 3000 // about 45 KB of names
	for i := range clusters {
		services.Services = append(services.Services, lookup.StaticService{
			Cluster: fmt.Sprintf("cluster-%05d", i), Namespace: "default", Name: "echo", Ports: map[string]string{"80": echo}})
	}
	env.StartAgentProcess(addr, agentID, services)
	d := env.Dialer(addr, "/kcp")
	for _, cluster := range []string{"cluster-00000", fmt.Sprintf("cluster-%05d", clusters-1)} {
		conn, err := dialEchoConnCluster(t.Context(), d, cluster)
		if err != nil {
			t.Fatalf("dialing %s: %v", cluster, err)
		}
		roundTrip(t, conn, cluster)
		conn.Close()
	}
}
