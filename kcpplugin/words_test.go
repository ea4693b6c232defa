package kcpplugin

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// gRPC's last connection errors, as its messages carry them, become words
// without the broker's address: the words of a ClientConn built without
// DialOptions, which recorded nothing.
func TestConnectionFailuresInWords(t *testing.T) {
	for _, tc := range []struct{ msg, want string }{
		{`latest balancer error: connection error: desc = "transport: Error while dialing: dial tcp 127.0.0.1:8499: connect: connection refused"`, "connection refused"},
		{`latest balancer error: name resolver error: produced zero addresses`, "no such host: the broker's name does not resolve"},
		{`connection error: desc = "transport: Error while dialing: dial tcp: lookup broker.kcp-system.svc on 10.96.0.10:53: no such host"`, "no such host: the broker's name does not resolve"},
		{`connection error: desc = "transport: authentication handshake failed: remote error: tls: bad certificate"`, "TLS handshake failed: the broker refused this client's certificate (bad certificate)"},
		{`connection error: desc = "error reading server preface: remote error: tls: unknown certificate authority"`, "TLS handshake failed: the broker refused this client's certificate (unknown certificate authority)"},
		{`connection error: desc = "transport: authentication handshake failed: tls: failed to verify certificate: x509: certificate signed by unknown authority"`, "TLS handshake failed: the broker's certificate was not accepted"},
		{`connection error: desc = "transport: authentication handshake failed: EOF"`, "TLS handshake failed"},
		{`write tcp 127.0.0.1:40448->127.0.0.1:44875: write: broken pipe`, "the broker closed the connection"},
		{`connection error: desc = "transport: Error while dialing: dial tcp 10.0.0.7:8443: i/o timeout"`, "connecting timed out"},
		{`something new 10.0.0.7:8443`, "cannot connect"},
	} {
		if got := connectionFailure(status.Error(codes.DeadlineExceeded, tc.msg)); got != tc.want {
			t.Errorf("connectionFailure(%q) = %q, want %q", tc.msg, got, tc.want)
		}
	}
}

// What DialOptions recorded becomes words by the error's type, whatever its
// text says.
func TestRecordedConnectionFailuresInWords(t *testing.T) {
	dialErr := func(err error) error { return &net.OpError{Op: "dial", Net: "tcp", Err: err} }
	for _, tc := range []struct {
		f    connFailure
		want string
	}{
		{connFailure{dialErr(os.NewSyscallError("connect", syscall.ECONNREFUSED)), stageDial}, "connection refused"},
		{connFailure{dialErr(os.NewSyscallError("connect", syscall.EHOSTUNREACH)), stageDial}, "no route to host"},
		{connFailure{dialErr(os.NewSyscallError("connect", syscall.ENETUNREACH)), stageDial}, "network is unreachable"},
		{connFailure{dialErr(os.ErrDeadlineExceeded), stageDial}, "connecting timed out"},
		{connFailure{dialErr(context.DeadlineExceeded), stageDial}, "connecting timed out"},
		// Its text says refused; its type says the name did not resolve.
		{connFailure{dialErr(&net.DNSError{Err: "connection refused", Name: "broker", IsNotFound: true}), stageDial}, "no such host: the broker's name does not resolve"},
		{connFailure{&net.OpError{Op: "write", Err: os.NewSyscallError("write", syscall.EPIPE)}, stageFirstBytes}, "the broker closed the connection"},
		{connFailure{&net.OpError{Op: "read", Err: os.NewSyscallError("read", syscall.ECONNRESET)}, stageFirstBytes}, "connection reset"},
		{connFailure{fmt.Errorf("reading: %w", errors.New("EOF, connection refused")), stageDial}, "cannot connect"},
		{connFailure{&tls.CertificateVerificationError{Err: x509.UnknownAuthorityError{}}, stageHandshake}, "TLS handshake failed: the broker's certificate was not accepted"},
		{connFailure{fmt.Errorf("x509svid: could not verify leaf certificate: %w", x509.CertificateInvalidError{Reason: x509.Expired}), stageHandshake},
			"TLS handshake failed: the broker's certificate has expired, or this client's clock is wrong"},
		{connFailure{errors.New("credentials: cannot check peer: missing selected ALPN property"), stageHandshake}, "TLS handshake failed"},
	} {
		err := &recordedError{status.Error(codes.DeadlineExceeded, "whatever gRPC said: x509 expired connection refused"), &tc.f}
		if got := connectionFailure(err); got != tc.want {
			t.Errorf("connectionFailure(%v at stage %d) = %q, want %q", tc.f.err, tc.f.stage, got, tc.want)
		}
		if status.Code(err) != codes.DeadlineExceeded {
			t.Errorf("the recorded error's status is %v, want gRPC's", status.Convert(err))
		}
	}
}

// Real failures, through a real gRPC client built with DialOptions, say
// why in words, without the broker's address: a closed port, a name that
// does not resolve, a broker that refuses the client's certificate, and one
// whose certificate the client does not accept.
func TestRealConnectionFailuresInWords(t *testing.T) {
	certs := selfSignedMTLS(t)
	stranger := selfSignedMTLS(t) // another CA: neither trusts the other's certificate
	serve := func(cfg *tls.Config) string {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		srv := grpc.NewServer(grpc.Creds(credentials.NewTLS(cfg)))
		tunnelv1.RegisterDialServiceServer(srv, &fakeBroker{})
		go srv.Serve(lis)
		t.Cleanup(srv.Stop)
		return lis.Addr().String()
	}
	refusing := certs.server.Clone()
	refusing.ClientCAs = stranger.client.RootCAs
	untrusted := certs.client.Clone()
	untrusted.RootCAs = stranger.client.RootCAs

	for _, tc := range []struct {
		name, addr string
		client     *tls.Config
		want       string
	}{
		{"a closed port", freeAddr(t), certs.client, "connection refused"},
		{"a name that does not resolve", "broker.invalid:8443", certs.client, "no such host: the broker's name does not resolve"},
		{"a refused certificate", serve(refusing), certs.client, "TLS handshake failed: the broker refused this client's certificate (unknown certificate authority)"},
		{"an untrusted broker", serve(certs.server), untrusted, "TLS handshake failed: the broker's certificate was not accepted"},
	} {
		t.Run(strings.ReplaceAll(tc.name, " ", "_"), func(t *testing.T) {
			cc, err := NewClient("passthrough:///"+tc.addr, credentials.NewTLS(tc.client))
			if err != nil {
				t.Fatal(err)
			}
			defer cc.Close()
			d := NewDialer(cc)
			d.Timeout = 2 * time.Second
			_, err = d.DialService(context.Background(), testCluster, testNamespace, testService, testPort)
			if status.Code(err) != codes.Unavailable || !strings.HasSuffix(status.Convert(err).Message(), ": "+tc.want) {
				t.Fatalf("dial: %v, want Unavailable: no tunnel broker reachable within ...: %s", err, tc.want)
			}
			// The words came from the record, by type, not from gRPC's text.
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			defer cancel()
			_, serr := tunnelv1.NewDialServiceClient(cc).Dial(ctx, grpc.WaitForReady(true))
			var rec *recordedError
			if !errors.As(serr, &rec) || failureInWords(rec.conn) != tc.want {
				t.Errorf("the stream's error %v carries no record saying %q", serr, tc.want)
			}
			if host, port, _ := net.SplitHostPort(tc.addr); strings.Contains(err.Error(), host) || strings.Contains(err.Error(), ":"+port) {
				t.Errorf("dial: %v names the broker's address %s", err, tc.addr)
			}
		})
	}
}
