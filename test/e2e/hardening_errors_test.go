package e2e

import (
	"context"
	"fmt"
	"net"
	"regexp"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// TestHardeningDialErrorsTellCallersWhyWithoutAddresses runs the broker and
// syncer-agent binaries and makes dials fail two ways: at a target that
// refuses, through the real agent, and at an agent that answers every
// order with a failure of 30 KiB full of addresses (near the broker's
// largest message, 32 KiB). kcp may show a dial's
// error to its end users: each caller gets a short message that says what
// failed and why, names no address and no SPIFFE ID, and gives the tunnel
// id under which the broker's and the agent's logs hold the details.
func TestHardeningDialErrorsTellCallersWhyWithoutAddresses(t *testing.T) {
	env := harness.NewEnv(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	refused := l.Addr().String()
	l.Close()
	broker, addr := env.StartBrokerProcess()
	agent := env.StartAgentProcess(addr, "/agent/sync-target-1", lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: "root", Namespace: "default", Name: "refused", Ports: map[string]string{"80": refused}},
	}})
	startLoudAgent(t, env, addr, "loud")
	kcp := env.Dialer(addr, "/kcp")

	t.Run("a refused target", func(t *testing.T) {
		_, err := kcp.DialService(t.Context(), "root", "default", "refused", 80)
		id := checkCallerMessage(t, err, codes.Unavailable, "agent sync-target-1: connecting to Service default/refused port 80: connection refused (tunnel ")
		agent.WaitLogged(t, 1, "tunnel="+id, refused, "connection refused")
		broker.WaitLogged(t, 1, "dial failed", "tunnel="+id, harness.ID("/agent/sync-target-1").String())
	})

	t.Run("an agent that says too much", func(t *testing.T) {
		_, err := kcp.DialService(t.Context(), "loud", "default", "webhook", 443)
		id := checkCallerMessage(t, err, codes.Unavailable, "agent loud: dial tcp <address>: connect: connection refused (pod <address>, node <address>, via <url>) padding")
		// The broker logs what the agent said, bounded, and how long it was.
		broker.WaitLogged(t, 1, "dial failed", "tunnel="+id, harness.ID("/agent/silent").String(),
			loudMessage[:200], fmt.Sprintf("agent_message_bytes=%d", len(loudMessage)))
	})
}

// loudMessage is what the loud agent answers every order with: addresses,
// a SPIFFE ID, and 30 KiB in all.
var loudMessage = func() string {
	s := "dial tcp 10.1.2.3:8443: connect: connection refused (pod [fd00::7]:8443, node 192.168.7.1, via spiffe://tunnel.test/agent/silent) "
	return s + strings.Repeat("padding ", (30<<10-len(s))/8)
}()

// startLoudAgent registers, as /agent/silent named loud (a name cannot
// carry an address: it must be a DNS-1123 label), for cluster, and answers
// every order with loudMessage.
func startLoudAgent(t *testing.T, env *harness.Env, brokerAddr, cluster string) {
	client := tunnelv1.NewAgentServiceClient(env.BrokerConn(brokerAddr, "/agent/silent"))
	ctx, cancel := context.WithCancel(context.Background())
	stream, err := client.Connect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	register := &tunnelv1.Register{Clusters: []string{cluster}, AgentName: "loud"}
	if err := stream.Send(&tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Register{Register: register}}); err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { cancel(); <-done })
	go func() {
		defer close(done)
		for {
			msg, err := stream.Recv()
			if err != nil {
				return
			}
			if o := msg.GetDialOrder(); o != nil {
				f := &tunnelv1.DialFailure{DialId: o.GetDialId(), Code: int32(codes.Unavailable), Message: loudMessage}
				if err := stream.Send(&tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_DialFailure{DialFailure: f}}); err != nil {
					return
				}
			}
		}
	}()
}

var tunnelIDRE = regexp.MustCompile(`\(tunnel ([0-9a-f]{16})\)$`)

// checkCallerMessage checks that err has code, that its message starts with
// prefix, is short and names no address nor SPIFFE ID, and ends with the
// tunnel id, which it returns.
func checkCallerMessage(t *testing.T, err error, code codes.Code, prefix string) string {
	t.Helper()
	st := status.Convert(err)
	msg := st.Message()
	if err == nil || st.Code() != code || !strings.HasPrefix(msg, prefix) {
		t.Fatalf("got %v %.300q, want %v %q...", st.Code(), msg, code, prefix)
	}
	if len(msg) > 512 {
		t.Errorf("the caller's message has %d bytes, want at most 512", len(msg))
	}
	for _, leak := range []string{"127.0.0.1", "10.", "192.168.", "fd00:", "spiffe://"} {
		if strings.Contains(msg, leak) {
			t.Errorf("the caller's message %q shows %q", msg, leak)
		}
	}
	m := tunnelIDRE.FindStringSubmatch(msg)
	if m == nil {
		t.Fatalf("the caller's message %q does not end with a tunnel id", msg)
	}
	return m[1]
}
