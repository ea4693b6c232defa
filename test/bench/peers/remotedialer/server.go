package main

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/rancher/remotedialer"
)

// maxRequest bounds a CONNECT request's bytes.
const maxRequest = 16 << 10

// serve runs remotedialer's server on an mTLS listener at addr, accepting
// only clientID, and the CONNECT front on socket, until ctx ends. It prints
// "listening <addr>" once both listen.
func serve(ctx context.Context, tlsConfig *tls.Config, addr, socket, clientID string) error {
	// The client's key is its SPIFFE ID, which the handshake has checked.
	authorize := func(req *http.Request) (string, bool, error) {
		if req.TLS == nil || len(req.TLS.PeerCertificates) == 0 {
			return "", false, nil
		}
		id := spiffeID(req.TLS.PeerCertificates[0])
		return id, id == clientID, nil
	}
	tunnels := remotedialer.New(authorize, remotedialer.DefaultErrorWriter)
	mux := http.NewServeMux()
	mux.Handle("/connect", tunnels)
	ws := &http.Server{Handler: mux, TLSConfig: tlsConfig, ReadHeaderTimeout: timeout}
	tl, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	defer ws.Close()
	go func() { _ = ws.ServeTLS(tl, "", "") }()

	front, err := net.Listen("unix", socket)
	if err != nil {
		return err
	}
	defer front.Close()
	go func() {
		for {
			c, err := front.Accept()
			if err != nil {
				return
			}
			go serveConnect(c, tunnels, clientID)
		}
	}()
	fmt.Fprintf(os.Stdout, "listening %s\n", tl.Addr())
	<-ctx.Done()
	return nil
}

// serveConnect answers one CONNECT host:port request on c with a connection
// dialed through the client's session, then copies both ways until either
// side ends.
func serveConnect(c net.Conn, tunnels *remotedialer.Server, clientID string) {
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(timeout))
	br := bufio.NewReader(io.LimitReader(c, maxRequest))
	req, err := http.ReadRequest(br)
	if err != nil {
		return
	}
	if req.Method != http.MethodConnect {
		_, _ = io.WriteString(c, "HTTP/1.1 405 Method Not Allowed\r\nConnection: close\r\n\r\n")
		return
	}
	out, err := dial(tunnels, clientID, req.URL.Host)
	if err != nil {
		fmt.Fprintf(os.Stderr, "remotedialer-peer: dialing %s: %v\n", req.URL.Host, err)
		_, _ = io.WriteString(c, "HTTP/1.1 502 Bad Gateway\r\nConnection: close\r\n\r\n")
		return
	}
	defer out.Close()
	if _, err := io.WriteString(c, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
		return
	}
	_ = c.SetDeadline(time.Time{})
	// Bytes the caller sent right after its request go first.
	if n := br.Buffered(); n > 0 {
		early, _ := br.Peek(n)
		if _, err := out.Write(early); err != nil {
			return
		}
	}
	// remotedialer's connections cannot half-close: the first direction to
	// end ends both, closing both connections to unblock the other copy.
	go func() {
		_, _ = io.Copy(c, out)
		c.Close()
		out.Close()
	}()
	_, _ = io.Copy(out, c)
}

// dial asks the client's session for a TCP connection to address, waiting
// (bounded) for the session right after the client connected: the server
// adds it just after the websocket handshake the client has seen complete.
// remotedialer's Dial returns once its request is sent, before the client
// has connected: a failed connect shows as the connection's end.
func dial(tunnels *remotedialer.Server, clientID, address string) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	for !tunnels.HasSession(clientID) {
		select {
		case <-ctx.Done():
			return nil, errors.New("no session of the client")
		case <-time.After(10 * time.Millisecond):
		}
	}
	return tunnels.Dialer(clientID)(ctx, "tcp", address)
}
