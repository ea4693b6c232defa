package main

import (
	"context"
	"flag"
	"io"
	"net"
	"os"
	"strconv"

	"google.golang.org/grpc"

	"github.com/kcp-dev/tunnel-broker/internal/flagcheck"
	"github.com/kcp-dev/tunnel-broker/kcpplugin"
)

// dial is the dial command: it pipes stdin and stdout through a tunnel,
// like nc: stdin's end half-closes the tunnel, and the command ends when
// the target closes.
func dial(*flag.FlagSet) func([]string) (runner, error) {
	return func(args []string) (runner, error) {
		if len(args) != 4 {
			return nil, flagcheck.Errorf("dial takes CLUSTER NAMESPACE SERVICE PORT, not %s", plural(len(args), "argument"))
		}
		port, err := strconv.ParseInt(args[3], 10, 32)
		if err != nil {
			return nil, flagcheck.Errorf("port %q is not a number", args[3])
		}
		return func(ctx context.Context, conn *grpc.ClientConn) error {
			c, err := kcpplugin.NewDialer(conn).DialService(ctx, args[0], args[1], args[2], int32(port))
			if err != nil {
				return err
			}
			defer c.Close()
			return pipe(c, stdio{})
		}, nil
	}
}

type stdio struct{}

func (stdio) Read(b []byte) (int, error)  { return os.Stdin.Read(b) }
func (stdio) Write(b []byte) (int, error) { return os.Stdout.Write(b) }
func (stdio) CloseWrite() error           { return nil }

type halfCloser interface {
	io.ReadWriter
	CloseWrite() error
}

// pipe copies both ways between a tunnel and a local end, passing each
// side's EOF on as a half-close, until both directions are done.
func pipe(tunnel net.Conn, local halfCloser) error {
	up := make(chan error, 1)
	go func() {
		_, err := io.Copy(tunnel, local)
		if cw, ok := tunnel.(interface{ CloseWrite() error }); ok {
			_ = cw.CloseWrite()
		}
		up <- err
	}()
	_, downErr := io.Copy(local, tunnel)
	_ = local.CloseWrite()
	if downErr != nil {
		return downErr
	}
	return <-up
}
