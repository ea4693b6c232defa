package egress

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"strings"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// readRequest reads one HTTP/1.1 request head from conn, of at most max
// bytes. The reader it returns holds what the client sent after the head
// (a client that does not wait for the 200), to be read before conn.
func readRequest(conn net.Conn, max int) (*http.Request, *bufio.Reader, error) {
	br := bufio.NewReaderSize(io.LimitReader(conn, int64(max)), 4096)
	req, err := http.ReadRequest(br)
	if err != nil {
		return nil, nil, fmt.Errorf("not an HTTP/1.1 request head of at most %d bytes: %w", max, err)
	}
	return req, br, nil
}

// parseAuthority makes the target of a CONNECT's host:port in cluster.
// The host is an IP address (a Service's cluster IP or an endpoint's, as
// kube-apiserver dials them) or a Service's name as
// name.namespace.svc[.cluster.local]; the port is a decimal 1-65535. All
// else is refused: the front end names Services, never arbitrary hosts.
func parseAuthority(authority, cluster string) (*tunnelv1.Target, error) {
	host, portText, err := net.SplitHostPort(authority)
	if err != nil {
		return nil, fmt.Errorf("the request target must be host:port: %v", err)
	}
	port, err := strconv.ParseUint(portText, 10, 16)
	if err != nil || port == 0 || strconv.FormatUint(port, 10) != portText {
		return nil, fmt.Errorf("port %q is not a decimal number in 1-65535", portText)
	}
	target := &tunnelv1.Target{Cluster: cluster, Port: uint32(port)}
	if ip, err := netip.ParseAddr(host); err == nil {
		if ip.Zone() != "" {
			return nil, fmt.Errorf("an address with an IPv6 zone names an interface of a host, not a Service")
		}
		target.Ip = ip.Unmap().String()
	} else if target.Namespace, target.Service, err = serviceName(host); err != nil {
		return nil, err
	}
	if err := target.Validate(); err != nil {
		return nil, err
	}
	return target, nil
}

// serviceName splits a Service's DNS name, name.namespace.svc or
// name.namespace.svc.cluster.local.
func serviceName(host string) (namespace, service string, err error) {
	labels := strings.Split(host, ".")
	switch {
	case len(labels) == 3 && labels[2] == "svc",
		len(labels) == 5 && labels[2] == "svc" && labels[3] == "cluster" && labels[4] == "local":
		return labels[1], labels[0], nil
	}
	return "", "", fmt.Errorf("host %.80q is neither an IP address nor a Service's name.namespace.svc[.cluster.local]", host)
}
