package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strings"
)

// connectName is the path through the broker's CONNECT front end (package
// egress), the way kube-apiserver's egress selector dials: a Unix socket,
// CONNECT name.namespace.svc:port, then the same tunnel as a Dial.
const connectName = "connect"

// egressFlags are the broker's flags for a CONNECT front end on a socket
// in dir, for the bench's cluster, if the broker binary has them.
func egressFlags(bin, dir string) (socket string, flags []string) {
	if !hasFlag(filepath.Join(bin, "broker"), "egress-uds") {
		return "", nil
	}
	socket = filepath.Join(dir, "egress.sock")
	return socket, []string{"--egress-uds", socket, "--egress-uds-cluster", cluster}
}

// connect is the CONNECT path of the pair, if its broker serves one.
func (p *pair) connect() (path, bool) {
	if p.egressSocket == "" {
		return path{}, false
	}
	return path{name: connectName, dial: func(ctx context.Context, svc string) (net.Conn, error) {
		port := portPlain
		if svc == svcWebhook {
			port = portWebhook
		}
		var d net.Dialer
		c, err := d.DialContext(ctx, "unix", p.egressSocket)
		if err != nil {
			return nil, err
		}
		if err := connectTo(c, fmt.Sprintf("%s.%s.svc:%d", svc, namespace, port)); err != nil {
			c.Close()
			return nil, err
		}
		return c, nil
	}}, true
}

// connectTo sends a CONNECT for authority and reads the answer's head byte
// by byte, so that nothing after it is taken from the connection.
func connectTo(c net.Conn, authority string) error {
	if _, err := fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", authority, authority); err != nil {
		return err
	}
	var head []byte
	b := make([]byte, 1)
	for !strings.HasSuffix(string(head), "\r\n\r\n") {
		if len(head) > 4<<10 {
			return errors.New("CONNECT answer head too long")
		}
		if _, err := c.Read(b); err != nil {
			return err
		}
		head = append(head, b[0])
	}
	if !strings.HasPrefix(string(head), "HTTP/1.1 200 ") {
		return fmt.Errorf("CONNECT %s: %s", authority, strings.SplitN(string(head), "\r\n", 2)[0])
	}
	return nil
}
