package main

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"os"

	"github.com/gorilla/websocket"
	"github.com/rancher/remotedialer"
)

// runClient connects to the server's websocket once and serves its dials
// until ctx ends or the tunnel drops: a benchmark must see a drop, not a
// quiet reconnect. It prints "connected" once the session is up.
func runClient(ctx context.Context, tlsConfig *tls.Config, url string) error {
	dialer := &websocket.Dialer{TLSClientConfig: tlsConfig, HandshakeTimeout: timeout}
	return remotedialer.ConnectToProxy(ctx, url, nil, loopbackOnly, dialer, func(context.Context, *remotedialer.Session) error {
		fmt.Fprintln(os.Stdout, "connected")
		return nil
	})
}

// loopbackOnly is the client's authorizer: the server may dial TCP to
// loopback addresses (the bench's targets) and nothing else.
func loopbackOnly(proto, address string) bool {
	host, _, err := net.SplitHostPort(address)
	if err != nil || proto != "tcp" {
		return false
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
