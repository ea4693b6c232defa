package egress

import (
	"errors"
	"io"
	"net/http"
	"syscall"
	"testing"

	"github.com/kcp-dev/tunnel-broker/broker/internal/brokertest"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// A CONNECT tunnel that fails after its 200 (its agent went away in the
// middle of a response) must not read as the response's clean end. Over
// TCP the broker resets the connection. A Unix socket has no reset: the
// caller reads the end of the stream, and what it learns is what its own
// protocol says of a stream that ends early. kube-apiserver speaks HTTP (in
// TLS) through the tunnel, whose message lengths tell: the response
// reads as cut short (unexpected EOF), not as complete.
func TestAConnectTunnelThatFailsAfterItsAnswerEndsInAnError(t *testing.T) {
	for _, c := range []struct {
		name, caller string
		start        func(t *testing.T) *frontEnd
		// what an HTTP client reads of the cut answer's body
		want func(err error) bool
		sees string
	}{
		{"over TCP", apiServerPath, startTLS,
			func(err error) bool { return errors.Is(err, syscall.ECONNRESET) }, "a connection reset"},
		{"over a Unix socket", "", func(t *testing.T) *frontEnd { return startUDS(t, "hcp-1") },
			func(err error) bool { return errors.Is(err, io.ErrUnexpectedEOF) }, "an answer cut short (the socket's end, and 100 bytes announced)"},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := c.start(t)
			agent := f.ConnectAgent(t, agentPath, "agent", "hcp-1")
			_, r := f.connect(t, c.caller, connectTo("webhook.default.svc:443"))
			order := agent.Order(t, &tunnelv1.Target{Cluster: "hcp-1", Namespace: "default", Service: "webhook", Port: 443})
			tun, cancelAgent := agent.Open(t, order.GetDialId())
			if code, body := answer(t, r); code != http.StatusOK {
				t.Fatalf("answer %d %s, want 200", code, body)
			}
			// The webhook starts its answer, and its agent goes away.
			start := "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"response\":"
			if err := tun.Send(brokertest.DataDown([]byte(start))); err != nil {
				t.Fatal(err)
			}
			resp, err := http.ReadResponse(r, &http.Request{Method: http.MethodPost})
			if err != nil {
				t.Fatalf("reading the webhook's answer: %v", err)
			}
			defer resp.Body.Close()
			cancelAgent()
			body, err := io.ReadAll(resp.Body)
			if !c.want(err) {
				t.Errorf("an HTTP client read the answer's body as %q, %v; want %s", body, err, c.sees)
			}
		})
	}
}
