package e2e

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	"github.com/kcp-dev/tunnel-broker/kcpplugin"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// TestBadInputs sends every kind of bad dial, through kcpplugin and straight
// to the broker's Dial RPC, and checks the status each gets. TestMain checks
// that nothing leaked.
func TestBadInputs(t *testing.T) {
	dialer, raw := startBadInputWorld(t)
	for _, tc := range badTargets {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()

			conn, err := dialer.DialService(ctx, tc.cluster, tc.namespace, tc.service, tc.port)
			if conn != nil {
				conn.Close()
			}
			testutil.CheckStatus(t, "kcpplugin", err, tc.code, tc.message)

			if tc.port < 0 || tc.port > 65535 {
				return // not expressible on the wire
			}
			err = rawDial(ctx, raw, &tunnelv1.Target{Cluster: tc.cluster, Namespace: tc.namespace, Service: tc.service, Port: uint32(tc.port)})
			testutil.CheckStatus(t, "Dial RPC", err, tc.code, tc.message)
		})
	}
	for _, tc := range badDialStreams {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			stream, err := raw.Dial(ctx)
			if err != nil {
				t.Fatal(err)
			}
			err = tc.run(t, stream)
			testutil.CheckStatus(t, "Dial RPC", err, codes.InvalidArgument, tc.message)
		})
	}
}

// startBadInputWorld starts a broker with a short dial timeout, an agent
// of cluster that serves an echo server and a port that refuses, and one
// of silent-cluster that ignores every order; it returns kcp's dialer and
// a client of the broker's Dial RPC.
func startBadInputWorld(t *testing.T) (*kcpplugin.Dialer, tunnelv1.DialServiceClient) {
	t.Helper()
	env := harness.NewEnv(t)
	b := env.StartBroker(harness.BrokerOptions{DialTimeout: 500 * time.Millisecond})

	// A port that refuses: listen, note the port, close.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	refused := l.Addr().String()
	l.Close()
	echo := harness.StartEcho(t)

	env.StartAgent(b.Addr, "/agent/sync-target-1", lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: cluster, Namespace: "default", Name: "echo", Ports: map[string]string{"80": echo}},
		{Cluster: cluster, Namespace: "default", Name: "refused", Ports: map[string]string{"80": refused}},
	}})
	// An agent that registers and then ignores every order.
	startSilentAgent(t, env, b.Addr, "silent-cluster")

	return env.Dialer(b.Addr, "/kcp"), tunnelv1.NewDialServiceClient(env.BrokerConn(b.Addr, "/kcp"))
}

// badTargets are dials of TestBadInputs that name a bad target, and the
// status each must get, through kcpplugin and on the Dial RPC.
var badTargets = []struct {
	name                        string
	cluster, namespace, service string
	port                        int32
	code                        codes.Code
	message                     string
}{
	{"cluster name with capitals", "Root", "default", "echo", 80, codes.InvalidArgument, "not a valid logical cluster name"},
	{"cluster path instead of name", "root:org", "default", "echo", 80, codes.InvalidArgument, "not a valid logical cluster name"},
	{"empty cluster", "", "default", "echo", 80, codes.InvalidArgument, "logical cluster"},
	{"namespace not a DNS-1123 label", cluster, "-default", "echo", 80, codes.InvalidArgument, "namespace"},
	{"namespace too long", cluster, strings.Repeat("n", 64), "echo", 80, codes.InvalidArgument, "namespace"},
	{"service not a DNS-1035 label", cluster, "default", "9echo", 80, codes.InvalidArgument, "service"},
	{"service with a dot", cluster, "default", "echo.default", 80, codes.InvalidArgument, "service"},
	{"port zero", cluster, "default", "echo", 0, codes.InvalidArgument, "port"},
	{"port too large", cluster, "default", "echo", 70000, codes.InvalidArgument, "port"},
	{"unknown cluster", "elsewhere", "default", "echo", 80, codes.Unavailable, `no agent serves logical cluster "elsewhere"`},
	{"unknown service", cluster, "default", "nope", 80, codes.NotFound, "no service default/nope"},
	{"unknown port", cluster, "default", "echo", 81, codes.NotFound, "port 81"},
	{"refused target", cluster, "default", "refused", 80, codes.Unavailable, "connection refused"},
	{"agent never answers", "silent-cluster", "default", "echo", 80, codes.DeadlineExceeded, "did not connect in time"},
}

// badDialStreams are Dial RPC streams of TestBadInputs that break the
// protocol: run drives the stream and returns its end, which must be
// InvalidArgument with message.
var badDialStreams = []struct {
	name    string
	run     func(t *testing.T, stream tunnelv1.DialService_DialClient) error
	message string
}{
	{"first message is data", func(t *testing.T, stream tunnelv1.DialService_DialClient) error {
		if err := stream.Send(&tunnelv1.DialRequest{Frame: &tunnelv1.DialRequest_Data{Data: []byte("x")}}); err != nil {
			t.Fatal(err)
		}
		_, err := stream.Recv()
		return err
	}, "must name a target"},
	{"stream closed before the target", func(t *testing.T, stream tunnelv1.DialService_DialClient) error {
		stream.CloseSend()
		_, err := stream.Recv()
		return err
	}, "before naming a target"},
	{"a second target after the first", func(t *testing.T, stream tunnelv1.DialService_DialClient) error {
		target := &tunnelv1.DialRequest{Frame: &tunnelv1.DialRequest_Target{Target: &tunnelv1.Target{Cluster: cluster, Namespace: "default", Service: "echo", Port: 80}}}
		stream.Send(target)
		if msg, err := stream.Recv(); err != nil || msg.GetEstablished() == nil {
			t.Fatalf("dial: %v %v", msg, err)
		}
		stream.Send(target)
		for {
			if _, err := stream.Recv(); err != nil {
				return err
			}
		}
	}, "may only send non-empty data"},
}

// rawDial sends one target on the Dial RPC and returns the broker's answer.
func rawDial(ctx context.Context, client tunnelv1.DialServiceClient, target *tunnelv1.Target) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := client.Dial(ctx)
	if err != nil {
		return err
	}
	if err := stream.Send(&tunnelv1.DialRequest{Frame: &tunnelv1.DialRequest_Target{Target: target}}); err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	msg, err := stream.Recv()
	if err != nil {
		return err
	}
	if msg.GetEstablished() == nil {
		return errors.New("no established frame")
	}
	return nil
}

// startSilentAgent registers an agent for cluster that never answers orders.
// The returned channel receives each order it ignores.
func startSilentAgent(t testing.TB, env *harness.Env, brokerAddr, cluster string) <-chan *tunnelv1.DialOrder {
	client := tunnelv1.NewAgentServiceClient(env.BrokerConn(brokerAddr, "/agent/silent"))
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	stream, err := client.Connect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	stream.Send(&tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Register{Register: &tunnelv1.Register{Clusters: []string{cluster}}}})
	if _, err := stream.Recv(); err != nil {
		t.Fatal(err)
	}
	orders := make(chan *tunnelv1.DialOrder, 100)
	go func() {
		for {
			msg, err := stream.Recv()
			if err != nil {
				return
			}
			if o := msg.GetDialOrder(); o != nil {
				select {
				case orders <- o:
				default:
				}
			}
		}
	}()
	return orders
}
