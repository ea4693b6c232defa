package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"

	"google.golang.org/grpc"

	"github.com/kcp-dev/tunnel-broker/internal/flagcheck"
	"github.com/kcp-dev/tunnel-broker/kcpplugin"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// portForward is the port-forward command: it listens on a local port and
// tunnels every connection to a Service port in a logical cluster, until
// interrupted.
func portForward(*flag.FlagSet) func([]string) (runner, error) {
	return func(args []string) (runner, error) {
		if len(args) != 2 {
			return nil, flagcheck.Errorf("port-forward takes LOCALPORT CLUSTER/NAMESPACE/SERVICE:PORT, not %s", plural(len(args), "argument"))
		}
		cluster, namespace, service, port, err := parseTarget(args[1])
		if err != nil {
			return nil, &flagcheck.FlagError{Err: err}
		}
		return func(ctx context.Context, conn *grpc.ClientConn) error {
			return forward(ctx, conn, args[0], cluster, namespace, service, port)
		}, nil
	}
}

// forward serves port-forward on 127.0.0.1:localPort.
func forward(ctx context.Context, conn *grpc.ClientConn, localPort, cluster, namespace, service string, port int32) error {
	l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", localPort))
	if err != nil {
		return fmt.Errorf("LOCALPORT %s: %w", localPort, err)
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
