package brokertest

import (
	"context"
	"errors"
	"io"
	"testing"

	"google.golang.org/protobuf/proto"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// This file plays the broker's peers by hand, with the generated clients:
// an agent on its control stream, and both ends of a tunnel.

// Agent is an agent played by hand over its control stream.
type Agent struct {
	s       *Server
	path    string
	Control tunnelv1.AgentService_ConnectClient
}

// ConnectAgent registers an agent named name, as the identity path, for
// clusters, and reads its registration. Its control stream lasts as long as
// the test t.
func (s *Server) ConnectAgent(t *testing.T, path, name string, clusters ...string) *Agent {
	t.Helper()
	return s.ConnectAgentWith(t, path, &tunnelv1.Register{Clusters: clusters, AgentName: name})
}

// ConnectAgentWith is ConnectAgent with the registration given whole.
func (s *Server) ConnectAgentWith(t *testing.T, path string, register *tunnelv1.Register) *Agent {
	t.Helper()
	ctx, _ := StreamContext(t)
	control, err := tunnelv1.NewAgentServiceClient(s.Conn(t, path)).Connect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	reg := &tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Register{Register: register}}
	if err := control.Send(reg); err != nil {
		t.Fatal(err)
	}
	msg, err := control.Recv()
	if err != nil || msg.GetRegistered() == nil {
		t.Fatalf("registering: %v, %v", msg, err)
	}
	return &Agent{s: s, path: path, Control: control}
}

// Order is the agent's next dial order, which must be for want; a drain on
// the way is skipped.
func (a *Agent) Order(t *testing.T, want *tunnelv1.Target) *tunnelv1.DialOrder {
	t.Helper()
	for {
		msg, err := a.Control.Recv()
		if err != nil {
			t.Fatalf("waiting for a dial order: %v", err)
		}
		if msg.GetDrain() != nil {
			continue
		}
		order := msg.GetDialOrder()
		if order == nil {
			t.Fatalf("agent got %v, want a dial order", msg)
		}
		if !proto.Equal(order.GetTarget(), want) {
			t.Fatalf("order for %v, want %v", order.GetTarget(), want)
		}
		return order
	}
}

// Open opens the agent's Tunnel for a dial.
func (a *Agent) Open(t *testing.T, dialID uint64) (tunnelv1.AgentService_TunnelClient, context.CancelFunc) {
	t.Helper()
	return a.s.OpenTunnel(t, a.path, dialID)
}

// Tunnel is one established tunnel: the caller's and the agent's streams.
type Tunnel struct {
	t                         *testing.T
	Caller                    tunnelv1.DialService_DialClient
	Agent                     tunnelv1.AgentService_TunnelClient
	CancelCaller, CancelAgent context.CancelFunc
}

// Establish dials target as the identity caller through a, and checks the
// broker's answer. The tunnel's streams last as long as the test t.
func (a *Agent) Establish(t *testing.T, caller string, target *tunnelv1.Target) *Tunnel {
	t.Helper()
	stream, cancelCaller := a.s.StartDial(t, caller, target)
	order := a.Order(t, target)
	tun, cancelAgent := a.Open(t, order.GetDialId())
	msg, err := stream.Recv()
	if err != nil {
		t.Fatalf("waiting for established: %v", err)
	}
	if msg.GetEstablished() == nil {
		t.Fatalf("first answer %v, want established", msg)
	}
	return &Tunnel{t: t, Caller: stream, Agent: tun, CancelCaller: cancelCaller, CancelAgent: cancelAgent}
}

// DataUp is a caller's data frame.
func DataUp(b []byte) *tunnelv1.DialRequest {
	return &tunnelv1.DialRequest{Frame: &tunnelv1.DialRequest_Data{Data: b}}
}

// DataDown is an agent's data frame.
func DataDown(b []byte) *tunnelv1.TunnelRequest {
	return &tunnelv1.TunnelRequest{Frame: &tunnelv1.TunnelRequest_Data{Data: b}}
}

// Up sends p from the caller and checks the agent receives exactly it.
func (tn *Tunnel) Up(p string) {
	tn.t.Helper()
	if err := tn.Caller.Send(DataUp([]byte(p))); err != nil {
		tn.t.Fatal(err)
	}
	msg, err := tn.Agent.Recv()
	if err != nil {
		tn.t.Fatalf("agent waiting for %q: %v", p, err)
	}
	if got := string(msg.GetData()); got != p {
		tn.t.Fatalf("agent got %v, want data %q", msg, p)
	}
}

// Down sends p from the agent and checks the caller receives exactly it.
func (tn *Tunnel) Down(p string) {
	tn.t.Helper()
	if err := tn.Agent.Send(DataDown([]byte(p))); err != nil {
		tn.t.Fatal(err)
	}
	msg, err := tn.Caller.Recv()
	if err != nil {
		tn.t.Fatalf("caller waiting for %q: %v", p, err)
	}
	if got := string(msg.GetData()); got != p {
		tn.t.Fatalf("caller got %v, want data %q", msg, p)
	}
}

// dataMessage is a message that may carry data: a DialResponse or a
// TunnelResponse.
type dataMessage interface{ GetData() []byte }

// streamEnd reads a stream to its end with recv and returns its status (nil
// for OK); anything but data on the way fails the test.
func streamEnd[M dataMessage](t *testing.T, who string, recv func() (M, error)) error {
	t.Helper()
	for {
		msg, err := recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		if msg.GetData() == nil {
			t.Fatalf("%s got %v before the end", who, msg)
		}
	}
}

// CallerEnd reads the caller's stream to its end and returns its status.
func (tn *Tunnel) CallerEnd() error {
	tn.t.Helper()
	return streamEnd(tn.t, "caller", tn.Caller.Recv)
}

// AgentEnd reads the agent's Tunnel stream to its end and returns its status.
func (tn *Tunnel) AgentEnd() error {
	tn.t.Helper()
	return streamEnd(tn.t, "agent", tn.Agent.Recv)
}

// CloseWriteUp half-closes the caller's direction and checks the agent
// hears it.
func (tn *Tunnel) CloseWriteUp() {
	tn.t.Helper()
	if err := tn.Caller.CloseSend(); err != nil {
		tn.t.Fatal(err)
	}
	msg, err := tn.Agent.Recv()
	if err != nil || msg.GetCloseWrite() == nil {
		tn.t.Fatalf("agent got %v, %v; want close_write", msg, err)
	}
}

// CloseWriteDown half-closes the agent's direction and checks the caller
// hears it.
func (tn *Tunnel) CloseWriteDown() {
	tn.t.Helper()
	if err := tn.Agent.CloseSend(); err != nil {
		tn.t.Fatal(err)
	}
	msg, err := tn.Caller.Recv()
	if err != nil || msg.GetCloseWrite() == nil {
		tn.t.Fatalf("caller got %v, %v; want close_write", msg, err)
	}
}

// CloseBoth half-closes both directions and checks both RPCs end with OK.
func (tn *Tunnel) CloseBoth() {
	tn.t.Helper()
	tn.CloseWriteUp()
	tn.CloseWriteDown()
	if err := tn.CallerEnd(); err != nil {
		tn.t.Errorf("caller's status: %v, want OK", err)
	}
	if err := tn.AgentEnd(); err != nil {
		tn.t.Errorf("agent's status: %v, want OK", err)
	}
}
