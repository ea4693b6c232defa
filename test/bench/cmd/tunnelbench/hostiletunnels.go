package main

import (
	"bytes"
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// hostileTunnelCase is what a hostile agent with a valid SVID sends on the
// Tunnel streams of dials kcp made through it, once they are established.
type hostileTunnelCase struct {
	name string
	// stall: kcp does not read its tunnels, so that the broker stops
	// reading the agent's Tunnel streams, and the agent sends data
	// messages until flow control stops it. Otherwise it sends all but the
	// last byte of a data message and stops.
	stall bool
	// small: whole data messages of 1 byte of data, 8 bytes each, a DATA
	// frame each; otherwise maximal ones in -hostile-frame frames.
	small bool
}

var hostileTunnelCases = []hostileTunnelCase{
	{"tunnel_unfinished", false, false},
	{"tunnel_stalled", true, false},
	{"tunnel_stalled_small", true, true},
}

// stallFill is what the agent tries to send on a stalled tunnel: more than
// flow control lets through (kcp's window, what the broker queues for it,
// and the broker's window for the Tunnel stream: about 2 MiB).
const stallFill = 4 << 20

// hostileTunnels measures what a hostile agent makes the broker hold with
// the tunnels kcp dials through it. For each case it starts a fresh broker,
// registers the agent (a gRPC client's control stream; its Tunnel streams
// go on one connection it speaks by hand, with -hostile-pad bytes of
// padding per DATA frame), establishes -hostile-tunnels tunnels one by one,
// has the agent send what the case says on all of them at once, and waits
// until nothing more goes out for a while (or the broker has ended them).
// It reports the broker's resident memory before, at its peak and after
// the tunnels ended, the data the agent got out per tunnel, and how many
// Tunnel streams the broker ended by itself. A line per case says how.
func (r *runner) hostileTunnels(ctx context.Context, c hostileTunnelCase) {
	cfg := r.cfg
	broker, addr := r.env.StartBrokerProcess()
	defer func() { _ = broker.Stop() }()
	pid := broker.Cmd.Process.Pid
	ctx, cancel := context.WithTimeout(ctx, cfg.hostileWait)
	defer cancel()

	agentConn := r.env.BrokerConn(addr, agentPath)
	defer agentConn.Close()
	control, err := tunnelv1.NewAgentServiceClient(agentConn).Connect(ctx)
	if err != nil {
		r.m.Fatal(err)
	}
	if err := control.Send(&tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Register{
		Register: &tunnelv1.Register{Clusters: []string{cluster}}}}); err != nil {
		r.m.Fatal(err)
	}
	if msg, err := control.Recv(); err != nil || msg.GetRegistered() == nil {
		r.m.Fatalf("registering the hostile agent: %v, %v", msg, err)
	}
	tunnels := r.env.RawConn(addr, agentPath)
	defer tunnels.Close()
	tunnels.Padding = cfg.hostilePad
	kcpConn := r.env.BrokerConn(addr, "/kcp")
	defer kcpConn.Close()
	dial := tunnelv1.NewDialServiceClient(kcpConn)

	time.Sleep(settle)
	before := r.rssMiB(pid)
	peak := before
	sampled := make(chan struct{})
	stopSampling := make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			peak = max(peak, r.rssMiB(pid))
			select {
			case <-stopSampling:
				return
			case <-time.After(50 * time.Millisecond):
			}
		}
	}()

	streams := make([]*harness.RawStream, 0, cfg.hostileTunnels)
	var setupErr error
	for range cfg.hostileTunnels {
		s, err := r.establishHostile(ctx, dial, control, tunnels)
		if err != nil {
			setupErr = err
			break
		}
		streams = append(streams, s)
	}

	// What each tunnel's agent sends, in frames of how much data.
	var payload []byte
	var what string
	frame := cfg.hostileFrame
	switch {
	case c.small:
		one := dataMessage(1)
		payload = bytes.Repeat(one, stallFill/len(one))
		frame = len(one)
		what = fmt.Sprintf("whole %d-byte messages, a frame each, kcp not reading", len(one))
	case c.stall:
		one := dataMessage(int(cfg.hostileMessage) - 16)
		payload = bytes.Repeat(one, stallFill/len(one)+1)
		what = fmt.Sprintf("%d-byte messages in %d-byte frames, kcp not reading", len(one), frame)
	default:
		payload = append(harness.GRPCPrefix(int(cfg.hostileMessage)), make([]byte, cfg.hostileMessage-1)...)
		what = fmt.Sprintf("all but the last byte of a %d-byte message in %d-byte frames", cfg.hostileMessage, frame)
	}
	work := make(chan *harness.RawStream)
	var wg sync.WaitGroup
	for range hostileWriters {
		wg.Go(func() {
			for s := range work {
				_ = s.Write(ctx, payload, frame)
			}
		})
	}
	go func() {
		for _, s := range streams {
			work <- s
		}
		close(work)
	}()
	// Until nothing more goes out for a few seconds.
	var sent int64
	for quiet := 0; quiet < 6 && ctx.Err() == nil; {
		time.Sleep(500 * time.Millisecond)
		now := int64(0)
		for _, s := range streams {
			now += s.Sent()
		}
		if now == sent {
			quiet++
		} else {
			quiet = 0
		}
		sent = now
	}
	codes := map[string]int{}
	for _, s := range streams {
		if isEnded(s) {
			codes[s.Status().Code().String()]++
		}
	}
	cancel() // the writers stop, kcp's dials end
	wg.Wait()
	tunnels.Close()
	close(stopSampling)
	<-sampled
	time.Sleep(settle)
	after := r.rssMiB(pid)

	ended := 0
	var summary []string
	for _, code := range slices.Sorted(maps.Keys(codes)) {
		ended += codes[code]
		summary = append(summary, fmt.Sprintf("%d ended by the broker with %s", codes[code], code))
	}
	if left := len(streams) - ended; left > 0 {
		summary = append(summary, fmt.Sprintf("%d held until the agent gave up", left))
	}
	if setupErr != nil {
		summary = append(summary, fmt.Sprintf("establishing stopped after %d: %v", len(streams), setupErr))
	}
	perTunnel := none
	if len(streams) > 0 {
		perTunnel = float64(sent) / float64(len(streams)) / (1 << 20)
	}
	r.report.note("hostile %s: %d tunnels of one agent, %s, %d bytes of padding per frame: %.2f MiB of data sent per tunnel; %s",
		c.name, len(streams), what, cfg.hostilePad, perTunnel, strings.Join(summary, ", "))
	name := "hostile_" + c.name + "_"
	r.report.hostileRow(name+"broker_rss_MiB_before", before)
	r.report.hostileRow(name+"broker_rss_MiB_peak", peak)
	r.report.hostileRow(name+"broker_rss_MiB_after", after)
	r.report.hostileRow(name+"MiB_sent_per_tunnel", perTunnel)
	r.report.hostileRow(name+"tunnels_ended_by_broker", float64(ended))
}

// establishHostile dials through the hostile agent as kcp and opens the
// agent's Tunnel stream for the dial on tunnels.
func (r *runner) establishHostile(ctx context.Context, dial tunnelv1.DialServiceClient, control tunnelv1.AgentService_ConnectClient,
	tunnels *harness.RawConn) (*harness.RawStream, error) {
	caller, err := dial.Dial(ctx)
	if err != nil {
		return nil, err
	}
	target := &tunnelv1.Target{Cluster: cluster, Namespace: namespace, Service: "hostile", Port: portPlain}
	if err := caller.Send(&tunnelv1.DialRequest{Frame: &tunnelv1.DialRequest_Target{Target: target}}); err != nil {
		return nil, err
	}
	var order *tunnelv1.DialOrder
	for order == nil {
		msg, err := control.Recv()
		if err != nil {
			return nil, fmt.Errorf("waiting for the dial order: %w", err)
		}
		order = msg.GetDialOrder()
	}
	s, err := tunnels.Open(tunnelv1.AgentService_Tunnel_FullMethodName)
	if err != nil {
		return nil, err
	}
	open, err := proto.Marshal(&tunnelv1.TunnelRequest{Frame: &tunnelv1.TunnelRequest_Open{Open: &tunnelv1.TunnelOpen{DialId: order.GetDialId()}}})
	if err != nil {
		return nil, err
	}
	if err := s.Write(ctx, harness.GRPCMessage(open), 16384); err != nil {
		return nil, err
	}
	if msg, err := caller.Recv(); err != nil || msg.GetEstablished() == nil {
		return nil, fmt.Errorf("waiting for established: %v, %v", msg, err)
	}
	return s, nil
}

// dataMessage is a TunnelRequest carrying n bytes of data, as a gRPC
// message.
func dataMessage(n int) []byte {
	m, err := proto.Marshal(&tunnelv1.TunnelRequest{Frame: &tunnelv1.TunnelRequest_Data{Data: make([]byte, n)}})
	if err != nil {
		panic(err)
	}
	return harness.GRPCMessage(m)
}

func isEnded(s *harness.RawStream) bool {
	select {
	case <-s.Ended():
		return true
	default:
		return false
	}
}
