package kcpplugin

import "testing"

// gRPC's last connection errors, as its messages carry them, become words
// without the broker's address.
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
		if got := connectionFailure(tc.msg); got != tc.want {
			t.Errorf("connectionFailure(%q) = %q, want %q", tc.msg, got, tc.want)
		}
	}
}
