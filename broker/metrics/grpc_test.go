package metrics_test

import (
	"context"
	"path"
	"testing"

	"google.golang.org/grpc"

	"github.com/kcp-dev/tunnel-broker/broker/internal/brokertest"
	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// stream is a server stream whose messages go nowhere.
type stream struct {
	grpc.ServerStream // not used: calling any other method panics
}

func (stream) Context() context.Context { return context.Background() }
func (stream) RecvMsg(any) error        { return nil }
func (stream) SendMsg(any) error        { return nil }

// runStream runs a stream of method through the interceptor; its handler
// receives and sends n messages each.
func runStream(t *testing.T, method string, n int) {
	t.Helper()
	handler := func(_ any, ss grpc.ServerStream) error {
		for range n {
			if err := ss.RecvMsg(nil); err != nil {
				return err
			}
			if err := ss.SendMsg(nil); err != nil {
				return err
			}
		}
		return nil
	}
	info := &grpc.StreamServerInfo{FullMethod: method, IsClientStream: true, IsServerStream: true}
	if err := metrics.StreamServerInterceptor()(nil, stream{}, info, handler); err != nil {
		t.Fatal(err)
	}
}

// series is the value of family's series for method (with code OK, for a
// family that has codes), 0 if it has none.
func series(t *testing.T, family, method string) float64 {
	t.Helper()
	v, _ := brokertest.Metric(t, family, func(labels map[string]string) bool {
		code, coded := labels["grpc_code"]
		return labels["grpc_method"] == method && (!coded || code == "OK")
	})
	return v
}

func TestDataStreamsAreCountedButNotTheirMessages(t *testing.T) {
	for _, method := range []string{tunnelv1.DialService_Dial_FullMethodName, tunnelv1.AgentService_Tunnel_FullMethodName} {
		name := path.Base(method)
		handled, received, sent := series(t, "grpc_server_handled_total", name), series(t, "grpc_server_msg_received_total", name), series(t, "grpc_server_msg_sent_total", name)
		runStream(t, method, 3)
		if got := series(t, "grpc_server_handled_total", name) - handled; got != 1 {
			t.Errorf("%s: handled_total grew by %v, want 1", method, got)
		}
		if got := series(t, "grpc_server_msg_received_total", name) - received; got != 0 {
			t.Errorf("%s: msg_received_total grew by %v, want 0: its messages are the tunnel's bytes", method, got)
		}
		if got := series(t, "grpc_server_msg_sent_total", name) - sent; got != 0 {
			t.Errorf("%s: msg_sent_total grew by %v, want 0", method, got)
		}
	}
}

func TestControlStreamsMessagesAreCounted(t *testing.T) {
	method := tunnelv1.AgentService_Connect_FullMethodName
	name := path.Base(method)
	received, sent := series(t, "grpc_server_msg_received_total", name), series(t, "grpc_server_msg_sent_total", name)
	runStream(t, method, 3)
	if got := series(t, "grpc_server_msg_received_total", name) - received; got != 3 {
		t.Errorf("msg_received_total grew by %v, want 3", got)
	}
	if got := series(t, "grpc_server_msg_sent_total", name) - sent; got != 3 {
		t.Errorf("msg_sent_total grew by %v, want 3", got)
	}
}
