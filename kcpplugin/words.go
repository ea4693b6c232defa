package kcpplugin

import "strings"

// connectionFailure says in words why gRPC could not connect to a broker,
// from the text of its last connection error, which names the broker's
// address ("dial tcp 10.96.0.7:8443: connect: connection refused"): kcp
// shows a dial's error to its end users, who get the words, never the
// addresses. Whatever it has no words for is "cannot connect". It is the
// one place kcpplugin reads an error's text: gRPC passes a connection's
// failure on to a waiting stream only as text, in its picker's status.
func connectionFailure(msg string) string {
	switch {
	case strings.Contains(msg, "authentication handshake failed"), strings.Contains(msg, "remote error: tls: "):
		if why := handshakeFailure(msg); why != "" {
			return "TLS handshake failed: " + why
		}
		return "TLS handshake failed"
	case strings.Contains(msg, "no such host"), strings.Contains(msg, "produced zero addresses"),
		strings.Contains(msg, "server misbehaving"):
		return "no such host: the broker's name does not resolve"
	case strings.Contains(msg, "connection refused"):
		return "connection refused"
	case strings.Contains(msg, "connection reset"):
		return "connection reset"
	case strings.Contains(msg, "broken pipe"):
		return "the broker closed the connection"
	case strings.Contains(msg, "no route to host"):
		return "no route to host"
	case strings.Contains(msg, "network is unreachable"):
		return "network is unreachable"
	case strings.Contains(msg, "i/o timeout"), strings.Contains(msg, "timed out"), strings.Contains(msg, "deadline exceeded"):
		return "connecting timed out"
	case strings.Contains(msg, "EOF"):
		return "the broker closed the connection"
	}
	return "cannot connect"
}

// handshakeFailure says which side refused a TLS handshake, if the
// message tells.
func handshakeFailure(msg string) string {
	const remote = "remote error: tls: "
	if i := strings.Index(msg, remote); i >= 0 {
		alert := msg[i+len(remote):]
		for _, a := range []string{"bad certificate", "expired certificate", "unknown certificate authority", "unknown certificate", "certificate required"} {
			if strings.HasPrefix(alert, a) {
				return "the broker refused this client's certificate (" + a + ")"
			}
		}
		return "the broker refused it"
	}
	switch {
	case strings.Contains(msg, "expired"):
		return "the broker's certificate has expired, or this client's clock is wrong"
	case strings.Contains(msg, "x509"), strings.Contains(msg, "verif"), strings.Contains(msg, "certificate"),
		strings.Contains(msg, "SPIFFE"), strings.Contains(msg, "spiffe"):
		return "the broker's certificate was not accepted"
	}
	return ""
}
