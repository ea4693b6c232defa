package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"math/big"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/internal/errinfo"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// failingAdmin fails ListAgents with err.
type failingAdmin struct {
	tunnelv1.UnimplementedAdminServiceServer
	err error
}

func (f *failingAdmin) ListAgents(context.Context, *tunnelv1.ListAgentsRequest) (*tunnelv1.ListAgentsResponse, error) {
	return nil, f.err
}

// serveOn serves srvCreds' gRPC with an AdminService that fails with err on
// a TCP port, and returns its address.
func serveOn(t *testing.T, srvCreds credentials.TransportCredentials, err error) string {
	t.Helper()
	l, lerr := net.Listen("tcp", "127.0.0.1:0")
	if lerr != nil {
		t.Fatal(lerr)
	}
	srv := grpc.NewServer(grpc.Creds(srvCreds))
	tunnelv1.RegisterAdminServiceServer(srv, &failingAdmin{err: err})
	go srv.Serve(l)
	t.Cleanup(srv.Stop)
	return l.Addr().String()
}

// callThrough calls ListAgents at addr as tunnelctl connects (connect's
// dialer and credentials, over creds) and explains its error.
func callThrough(t *testing.T, addr string, creds credentials.TransportCredentials) string {
	t.Helper()
	lastConn.set(nil, false)
	conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithContextDialer(dialBroker),
		grpc.WithTransportCredentials(recordingCreds{creds}))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	_, err = tunnelv1.NewAdminServiceClient(conn).ListAgents(ctx, &tunnelv1.ListAgentsRequest{})
	if err == nil {
		t.Fatal("ListAgents succeeded")
	}
	return explain(err)
}

// The broker's reason, not its words, chooses the hint: the same words
// without the reason get the code's hint.
func TestHintsFollowTheBrokersReason(t *testing.T) {
	for _, tc := range []struct {
		err       error
		want, not string
	}{
		{errinfo.Error(codes.Unavailable, errinfo.NoAgent, `no agent serves logical cluster "root"`), "no agent serves that cluster on this broker replica", ""},
		{errinfo.Error(codes.Unavailable, errinfo.AgentGone, "agent a1 went away (tunnel 0000000000000001)"), "the agent went away during the dial", ""},
		{errinfo.Error(codes.Unavailable, errinfo.TunnelLost, "tunnel lost on the agent's side: the agent stopped (tunnel 0000000000000001)"), "the agent's end of the tunnel ended", ""},
		{errinfo.Error(codes.Unavailable, errinfo.ReplicaDraining, "this broker replica is shutting down: dial another"), "this broker replica is shutting down", ""},
		{errinfo.Error(codes.Unavailable, errinfo.TargetRefused, "agent a1: connecting to Service default/web port 80: connection refused (tunnel 0000000000000001)"),
			"its port refused the connection", ""},
		{errinfo.Error(codes.Unavailable, errinfo.NoEndpoints, "agent a1: Service default/web port 80 has no endpoints (tunnel 0000000000000001)"),
			"it has no endpoints: are its pods ready?", ""},
		{errinfo.Error(codes.Unavailable, errinfo.TargetUnreachable, "agent a1: connecting to Service default/web port 80: no route to host (tunnel 0000000000000001)"),
			"could not connect to the Service's endpoints", ""},
		// The agent's words without its reason: no finer hint.
		{errinfo.Error(codes.Unavailable, errinfo.AgentDialFailed, "agent a1: Service default/web port 80 has no endpoints (tunnel 0000000000000001)"),
			"the agent could not connect the dial", "no endpoints: are its pods ready"},
		{errinfo.Error(codes.PermissionDenied, errinfo.AgentDialFailed, "agent a1: refused (tunnel 0000000000000001)"), "the agent refused that target", "broker's policy"},
		{errinfo.Error(codes.PermissionDenied, "SOMETHING_NEW", "denied"), "broker's policy", ""},
		// The words of NO_AGENT, without its reason: the code's hint.
		{status.Error(codes.Unavailable, `no agent serves logical cluster "root"`), "no agent could carry the tunnel now", "this broker replica"},
	} {
		addr := serveOn(t, insecure.NewCredentials(), tc.err)
		out := callThrough(t, addr, insecure.NewCredentials())
		if !strings.Contains(out, tc.want) || (tc.not != "" && strings.Contains(out, tc.not)) {
			t.Errorf("%v: %q, want the hint %q (and not %q)", tc.err, out, tc.want, tc.not)
		}
	}
}

// tunnelctl's own connection failures get their hint by the error's type,
// as its dialer and credentials saw it.
func TestHintsForTunnelctlsOwnConnection(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := l.Addr().String()
	l.Close()
	if out := callThrough(t, closed, insecure.NewCredentials()); !strings.Contains(out, "nothing listens at --broker") {
		t.Errorf("closed port: %q, want nothing listens", out)
	}
	if out := callThrough(t, "broker.invalid:8443", insecure.NewCredentials()); !strings.Contains(out, "the broker's name in --broker does not resolve") {
		t.Errorf("unresolvable name: %q, want the name does not resolve", out)
	}
	// A broker whose certificate the client does not trust.
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	addr := serveOn(t, credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}}), nil)
	out := callThrough(t, addr, credentials.NewTLS(&tls.Config{RootCAs: x509.NewCertPool()}))
	if !strings.Contains(out, "the TLS handshake with the broker failed") {
		t.Errorf("untrusted broker: %q, want the TLS handshake failed", out)
	}
}
