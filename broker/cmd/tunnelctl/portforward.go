package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"

	"google.golang.org/grpc"

	"github.com/kcp-dev/tunnel-broker/kcpplugin"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// portForward listens on a local port and tunnels every connection to a
// Service port in a logical cluster, until interrupted.
func portForward(ctx context.Context, conn *grpc.ClientConn, args []string) error {
	if len(args) != 2 {
		return errors.New("usage: port-forward LOCALPORT CLUSTER/NAMESPACE/SERVICE:PORT")
	}
	cluster, namespace, service, port, err := parseTarget(args[1])
	if err != nil {
		return err
	}
	l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", args[0]))
	if err != nil {
		return err
	}
	defer l.Close()
	context.AfterFunc(ctx, func() { l.Close() })
	target := &tunnelv1.Target{Cluster: cluster, Namespace: namespace, Service: service, Port: uint32(port)}
	fmt.Fprintf(os.Stderr, "Forwarding from %s -> %s\n", l.Addr(), target.Key())
	dialer := kcpplugin.NewDialer(conn)
	for {
		local, err := l.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		go func() {
			defer local.Close()
			tunnel, err := dialer.DialService(ctx, cluster, namespace, service, port)
			if err != nil {
				fmt.Fprintln(os.Stderr, "tunnelctl: connection from", local.RemoteAddr(), "failed:", explain(err))
				return
			}
			defer tunnel.Close()
			fmt.Fprintln(os.Stderr, "Handling connection from", local.RemoteAddr())
			_ = pipe(tunnel, local.(*net.TCPConn))
		}()
	}
}

// parseTarget splits CLUSTER/NAMESPACE/SERVICE:PORT.
func parseTarget(s string) (cluster, namespace, service string, port int32, err error) {
	// The port follows the last colon: a cluster name may be system:...
	i := strings.LastIndex(s, ":")
	if i < 0 {
		return "", "", "", 0, fmt.Errorf("target %q: want CLUSTER/NAMESPACE/SERVICE:PORT", s)
	}
	path, portText := s[:i], s[i+1:]
	parts := strings.Split(path, "/")
	if len(parts) != 3 {
		return "", "", "", 0, fmt.Errorf("target %q: want CLUSTER/NAMESPACE/SERVICE:PORT", s)
	}
	p, err := strconv.ParseInt(portText, 10, 32)
	if err != nil {
		return "", "", "", 0, fmt.Errorf("target %q: port %q is not a number", s, portText)
	}
	return parts[0], parts[1], parts[2], int32(p), nil
}
