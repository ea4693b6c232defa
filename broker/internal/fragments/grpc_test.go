package fragments_test

import (
	"bytes"
	"crypto/sha256"
	"crypto/tls"
	"errors"
	"github.com/kcp-dev/tunnel-broker/broker/admission"
	"io"
	"log/slog"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	agentv1 "github.com/kcp-dev/tunnel-broker/broker/api/agent/v1"
	dialv1 "github.com/kcp-dev/tunnel-broker/broker/api/dial/v1"
	"github.com/kcp-dev/tunnel-broker/broker/internal/brokertest"
	"github.com/kcp-dev/tunnel-broker/broker/internal/fragments"
	"github.com/kcp-dev/tunnel-broker/broker/policy"
	brokertunnel "github.com/kcp-dev/tunnel-broker/broker/tunnel"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// These tests run the dial and agent services behind Refuse, over real gRPC
// and SPIFFE mTLS (brokertest), with gRPC's own dynamic windows, whose
// updates come more often than the broker's fixed ones. kcp and the agent
// are gRPC clients; mallory speaks HTTP/2 by hand.

const (
	kcpPath     = "/kcp"
	malloryPath = "/mallory"
	agentPath   = "/agent"
)

var testPolicy = policy.File{
	Agents: []policy.AgentRule{{ID: brokertest.ID(agentPath).String(), Clusters: []string{"*"}}},
	Callers: []policy.CallerRule{
		{ID: brokertest.ID(kcpPath).String()},
		{ID: brokertest.ID(malloryPath).String()},
	},
}

type broker struct {
	*brokertest.Server
	closed atomic.Int64
	log    testutil.LogBuffer
}

func startBroker(t *testing.T) *broker {
	t.Helper()
	b := &broker{}
	refuse := func(creds credentials.TransportCredentials) credentials.TransportCredentials {
		return fragments.Refuse(creds, fragments.Report{
			Log:   slog.New(slog.NewTextHandler(&b.log, nil)),
			Count: func() { b.closed.Add(1) },
		})
	}
	b.Server = brokertest.StartWithCredentials(t, testPolicy, refuse, nil, func(s *brokertest.Server, srv *grpc.Server) {
		dialv1.RegisterService(srv, dialv1.New(dialv1.Config{Admission: admission.New(admission.Config{
			Registry: s.Registry, Policy: s.Policy, Timeout: testutil.WaitLong,
			Tunnels: brokertunnel.Config{Stopping: s.Stopping}, Draining: s.Draining, Log: s.Log,
		})}))
		agentv1.RegisterService(srv, agentv1.New(agentv1.Config{
			Registry: s.Registry, Policy: s.Policy, BrokerID: "test-broker",
			Draining: s.Draining, Stopping: s.Stopping, ProbeEvery: time.Hour, Log: s.Log,
		}))
	})
	return b
}

// tunnel is an established tunnel: kcp's Dial stream and the agent's Tunnel
// stream, on connections of their own.
type tunnel struct {
	caller tunnelv1.DialService_DialClient
	agent  tunnelv1.AgentService_TunnelClient
}

// establish registers an agent for root and dials root through it.
func (b *broker) establish(t *testing.T) *tunnel {
	t.Helper()
	ctx, _ := brokertest.StreamContext(t)
	control, err := tunnelv1.NewAgentServiceClient(b.Conn(t, agentPath)).Connect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	reg := &tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Register{Register: &tunnelv1.Register{Clusters: []string{"root"}}}}
	if err := control.Send(reg); err != nil {
		t.Fatal(err)
	}
	if msg, err := control.Recv(); err != nil || msg.GetRegistered() == nil {
		t.Fatalf("registering: %v, %v", msg, err)
	}
	caller, _ := b.StartDial(t, kcpPath, brokertest.Target("root"))
	msg, err := control.Recv()
	if err != nil || msg.GetDialOrder() == nil {
		t.Fatalf("waiting for the dial order: %v, %v", msg, err)
	}
	agent, _ := b.OpenTunnel(t, agentPath, msg.GetDialOrder().GetDialId())
	if msg, err := caller.Recv(); err != nil || msg.GetEstablished() == nil {
		t.Fatalf("waiting for established: %v, %v", msg, err)
	}
	return &tunnel{caller: caller, agent: agent}
}

// roundTrip sends p each way and checks it arrives.
func (tn *tunnel) roundTrip(t *testing.T, p string) {
	t.Helper()
	if err := tn.caller.Send(&tunnelv1.DialRequest{Frame: &tunnelv1.DialRequest_Data{Data: []byte(p)}}); err != nil {
		t.Fatal(err)
	}
	if msg, err := tn.agent.Recv(); err != nil || string(msg.GetData()) != p {
		t.Fatalf("agent got %v, %v; want %q", msg, err, p)
	}
	if err := tn.agent.Send(&tunnelv1.TunnelRequest{Frame: &tunnelv1.TunnelRequest_Data{Data: []byte(p)}}); err != nil {
		t.Fatal(err)
	}
	if msg, err := tn.caller.Recv(); err != nil || string(msg.GetData()) != p {
		t.Fatalf("caller got %v, %v; want %q", msg, err, p)
	}
}

// sendInFragments connects as path by hand, opens a Dial stream, sends the
// first n bytes of a longer message in 1-byte DATA frames, and reads the
// connection to its end; it returns the GOAWAY the broker sent, if any.
func (b *broker) sendInFragments(t *testing.T, path string, n int) *http2.GoAwayFrame {
	t.Helper()
	conn, err := tls.Dial("tcp", b.Addr, b.ClientTLS(t, path))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if err := conn.SetDeadline(time.Now().Add(testutil.WaitLong)); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	out.WriteString(http2.ClientPreface)
	fr := http2.NewFramer(&out, conn)
	var block bytes.Buffer
	enc := hpack.NewEncoder(&block)
	for _, f := range [][2]string{
		{":method", "POST"}, {":scheme", "https"}, {":path", tunnelv1.DialService_Dial_FullMethodName},
		{":authority", "broker"}, {"content-type", "application/grpc"}, {"te", "trailers"},
	} {
		_ = enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	err = errors.Join(fr.WriteSettings(), fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: block.Bytes(), EndHeaders: true}))
	message := append([]byte{0, 0, 0, byte(n >> 8), byte(n)}, make([]byte, n-5)...)
	for _, c := range message {
		err = errors.Join(err, fr.WriteData(1, false, []byte{c}))
	}
	if err != nil {
		t.Fatal(err)
	}
	// Within HTTP/2's initial windows; the broker may close the connection
	// before it has all.
	_, _ = conn.Write(out.Bytes())
	var goAway *http2.GoAwayFrame
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			if !errors.Is(err, io.EOF) {
				t.Logf("the connection ended with %v", err)
			}
			return goAway
		}
		if g, ok := f.(*http2.GoAwayFrame); ok {
			goAway = &http2.GoAwayFrame{FrameHeader: g.FrameHeader, LastStreamID: g.LastStreamID, ErrCode: g.ErrCode}
			t.Logf("GOAWAY %v: %s", g.ErrCode, g.DebugData())
			if !strings.Contains(string(g.DebugData()), "fragmented data") {
				t.Errorf("GOAWAY says %q, want it to say fragmented data", g.DebugData())
			}
		}
	}
}

func TestAPeerThatSendsOneByteFramesLosesItsConnectionWhileOthersGoOn(t *testing.T) {
	b := startBroker(t)
	tn := b.establish(t)
	tn.roundTrip(t, "before")

	goAway := b.sendInFragments(t, malloryPath, 4000)
	if goAway == nil || goAway.ErrCode != http2.ErrCodeEnhanceYourCalm || goAway.LastStreamID != 1 {
		t.Fatalf("the broker said %+v before closing, want GOAWAY ENHANCE_YOUR_CALM, last stream 1", goAway)
	}
	if n := b.closed.Load(); n != 1 {
		t.Errorf("%d connections counted as closed, want 1", n)
	}
	if logged := b.log.String(); !strings.Contains(logged, "closing a connection whose peer sends its data in fragments") ||
		!strings.Contains(logged, brokertest.ID(malloryPath).String()) {
		t.Errorf("logged %q, want a line naming mallory", logged)
	}
	// kcp's and the agent's connections, and their tunnel, go on.
	tn.roundTrip(t, "after")
}

func TestBulkTransfersBothWaysAreNotRefused(t *testing.T) {
	b := startBroker(t)
	tn := b.establish(t)
	const total = 32 << 20
	// Messages of every size, the smallest a byte of data, so that gRPC's
	// windows stop the senders at every point of a message.
	rng := rand.New(rand.NewPCG(5, 6))
	var sizes []int
	for sent := 0; sent < total; {
		n := min(1+rng.IntN(32<<10-16), total-sent)
		if rng.IntN(10) == 0 {
			n = 1
		}
		sizes = append(sizes, n)
		sent += n
	}
	payload := make([]byte, 32<<10)
	for i := range payload {
		payload[i] = byte(rng.Uint32())
	}
	want := digest(sizes, payload)

	var wg sync.WaitGroup
	var upSum, downSum [sha256.Size]byte
	var upErr, downErr error
	wg.Go(func() {
		for _, n := range sizes {
			if err := tn.caller.Send(&tunnelv1.DialRequest{Frame: &tunnelv1.DialRequest_Data{Data: payload[:n]}}); err != nil {
				upErr = err
				return
			}
		}
	})
	wg.Go(func() {
		for _, n := range sizes {
			if err := tn.agent.Send(&tunnelv1.TunnelRequest{Frame: &tunnelv1.TunnelRequest_Data{Data: payload[:n]}}); err != nil {
				downErr = err
				return
			}
		}
	})
	wg.Go(func() {
		upSum = received(total, func() ([]byte, error) { m, err := tn.agent.Recv(); return m.GetData(), err })
	})
	wg.Go(func() {
		downSum = received(total, func() ([]byte, error) { m, err := tn.caller.Recv(); return m.GetData(), err })
	})
	wg.Wait()
	if upErr != nil || downErr != nil {
		t.Fatalf("sending: up %v, down %v", upErr, downErr)
	}
	if upSum != want || downSum != want {
		t.Errorf("the data arrived altered or cut short")
	}
	if n := b.closed.Load(); n != 0 {
		t.Errorf("%d connections closed: %s", n, b.log.String())
	}
}

// digest is the SHA-256 of the messages of sizes, each the start of payload.
func digest(sizes []int, payload []byte) [sha256.Size]byte {
	h := sha256.New()
	for _, n := range sizes {
		h.Write(payload[:n])
	}
	return [sha256.Size]byte(h.Sum(nil))
}

// received is the SHA-256 of total bytes of data that recv receives.
func received(total int, recv func() ([]byte, error)) [sha256.Size]byte {
	h := sha256.New()
	for got := 0; got < total; {
		data, err := recv()
		if err != nil {
			break
		}
		h.Write(data)
		got += len(data)
	}
	return [sha256.Size]byte(h.Sum(nil))
}
