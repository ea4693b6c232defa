package main

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"time"

	"google.golang.org/grpc"
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
	ctx, cancel := context.WithTimeout(ctx, cfg.hostileWait)
	defer cancel()
	agent := r.registerHostileAgent(ctx, addr)
	defer agent.close()
	rss := r.watchRSS(broker.Cmd.Process.Pid)

	streams, setupErr := r.establishHostileTunnels(ctx, agent)
	payload, frame, what := c.payload(cfg)
	wait := writeAll(ctx, streams, payload, frame)
	sent := sentUntilQuiet(ctx, streams)
	codes := endedCodes(streams)
	cancel() // the writers stop, kcp's dials end
	wait()
	agent.tunnels.Close()
	rss.stop()
	after := rss.settled()

	summary, ended := countsByCode(codes, "%d ended by the broker with %s")
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
	rss.rows(name, after)
	r.report.hostileRow(name+"MiB_sent_per_tunnel", perTunnel)
	r.report.hostileRow(name+"tunnels_ended_by_broker", float64(ended))
}

// hostileAgent is the hostile agent's side of a broker, and kcp's: the
// agent registers on a gRPC client's control stream and opens its Tunnel
// streams on a connection it speaks by hand; kcp dials through it.
type hostileAgent struct {
	conn    *grpc.ClientConn // the agent's control connection
	control tunnelv1.AgentService_ConnectClient
	tunnels *harness.RawConn
	kcpConn *grpc.ClientConn
	dial    tunnelv1.DialServiceClient
}

// registerHostileAgent registers the hostile agent for cluster with the
// broker at addr, and connects kcp.
func (r *runner) registerHostileAgent(ctx context.Context, addr string) *hostileAgent {
	a := &hostileAgent{conn: r.env.BrokerConn(addr, agentPath)}
	control, err := tunnelv1.NewAgentServiceClient(a.conn).Connect(ctx)
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
	a.control = control
	a.tunnels = r.env.RawConn(addr, agentPath)
	a.tunnels.Padding = r.cfg.hostilePad
	a.kcpConn = r.env.BrokerConn(addr, "/kcp")
	a.dial = tunnelv1.NewDialServiceClient(a.kcpConn)
	return a
}

// close closes kcp's connection and the agent's, last opened first.
func (a *hostileAgent) close() {
	a.kcpConn.Close()
	a.tunnels.Close()
	a.conn.Close()
}

// establishHostileTunnels establishes -hostile-tunnels tunnels through the
// agent, one by one, and stops at the first that fails.
func (r *runner) establishHostileTunnels(ctx context.Context, a *hostileAgent) ([]*harness.RawStream, error) {
	streams := make([]*harness.RawStream, 0, r.cfg.hostileTunnels)
	for range r.cfg.hostileTunnels {
		s, err := a.establish(ctx)
		if err != nil {
			return streams, err
		}
		streams = append(streams, s)
	}
	return streams, nil
}

// payload is what the agent sends on each tunnel in case c, in frames of
// how many bytes, and what the case's line says of it.
func (c hostileTunnelCase) payload(cfg config) (payload []byte, frame int, what string) {
	frame = cfg.hostileFrame
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
	return payload, frame, what
}

// sentUntilQuiet polls what the agent got out on streams every half second
// until nothing more went out for a few seconds (or ctx ended), and returns
// the total: flow control, or the broker, has stopped the agent by then.
func sentUntilQuiet(ctx context.Context, streams []*harness.RawStream) int64 {
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
	return sent
}

// endedCodes counts, by status code, the streams the broker has ended so
// far; the others are still held.
func endedCodes(streams []*harness.RawStream) map[string]int {
	codes := map[string]int{}
	for _, s := range streams {
		if isEnded(s) {
			codes[s.Status().Code().String()]++
		}
	}
	return codes
}

// establish dials through the hostile agent as kcp and opens the agent's
// Tunnel stream for the dial on its hand-spoken connection.
func (a *hostileAgent) establish(ctx context.Context) (*harness.RawStream, error) {
	caller, err := a.dial.Dial(ctx)
	if err != nil {
		return nil, err
	}
	target := &tunnelv1.Target{Cluster: cluster, Namespace: namespace, Service: "hostile", Port: portPlain}
	if err := caller.Send(&tunnelv1.DialRequest{Frame: &tunnelv1.DialRequest_Target{Target: target}}); err != nil {
		return nil, err
	}
	var order *tunnelv1.DialOrder
	for order == nil {
		msg, err := a.control.Recv()
		if err != nil {
			return nil, fmt.Errorf("waiting for the dial order: %w", err)
		}
		order = msg.GetDialOrder()
	}
	s, err := a.tunnels.Open(tunnelv1.AgentService_Tunnel_FullMethodName)
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
