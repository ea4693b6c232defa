package agent

import (
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	"github.com/kcp-dev/tunnel-broker/broker/internal/brokertest"
	"github.com/kcp-dev/tunnel-broker/internal/devca"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

func TestAnAgentsRegistrationEndsWhenItsSVIDExpires(t *testing.T) {
	clk := brokertest.NewClock()
	// No probe is due before the expiry.
	b := startBroker(t, config{clock: clk, probeEvery: 2 * time.Hour})
	src, err := b.CA.Source(devca.Leaf{SPIFFEID: agentA, NotAfter: clk.Now().Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	svid, _ := src.GetX509SVID()
	expires := svid.Certificates[0].NotAfter
	cc, err := grpc.NewClient("passthrough:///"+b.Addr, grpc.WithTransportCredentials(
		identity.ClientCredentials(src, tlsconfig.AuthorizeID(brokertest.ID(brokertest.BrokerPath)))))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	ctx, _ := brokertest.StreamContext(t)
	control, err := tunnelv1.NewAgentServiceClient(cc).Connect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	reg := register("root")
	reg.GetRegister().AgentName = "a"
	if err := control.Send(reg); err != nil {
		t.Fatal(err)
	}
	if msg, err := control.Recv(); err != nil || msg.GetRegistered() == nil {
		t.Fatalf("registering: %v, %v", msg, err)
	}
	if b.registered("a") == nil {
		t.Fatal("the agent is not routable")
	}
	// The probe ticker and the expiry's timer wait on the clock.
	clk.WaitForTimers(t, 2)
	clk.Step(time.Hour)

	// Its control stream ends at the expiry, saying why, and nothing more
	// is routed to it.
	_, err = control.Recv()
	testutil.CheckStatus(t, "Connect", err, codes.Unauthenticated,
		"the X.509-SVID of spiffe://example.org/agent-a expired at "+expires.UTC().Format(time.RFC3339))
	testutil.Eventually(t, "the agent to be unrouted", func() bool { return b.registered("a") == nil })
	testutil.CheckStatus(t, "Dial", dialStatus(t, b.startDial(t, brokertest.Target("root"))), codes.Unavailable, `no agent serves logical cluster "root"`)
}
