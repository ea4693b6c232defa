// Command streamfloor measures what one idle gRPC stream costs a grpc-go
// server, with nothing of ours in it: the floor under the broker's cost per
// idle tunnel, which holds two such streams (the caller's Dial and the
// agent's Tunnel). See BENCHMARKS.md.
//
// It serves a bidirectional stream whose handler waits in Recv, has a child
// process (itself, re-run) open -n streams and send one message on each,
// then prints the growth of its heap, goroutine stacks and goroutines per
// stream, as the Go runtime counts them (after a GC), on one comment line.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"os/exec"
	"runtime"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"

	"github.com/kcp-dev/tunnel-broker/test/bench"
)

const childEnv = "STREAMFLOOR_SERVER"

func main() {
	n := flag.Int("n", 10000, "idle streams to open")
	flag.Parse()
	if addr := os.Getenv(childEnv); addr != "" {
		if err := openStreams(addr, *n); err != nil {
			log.Fatal(err)
		}
		return
	}
	if err := measure(*n); err != nil {
		log.Fatal(err)
	}
}

// server is a FullDuplexCall that reads until the stream ends.
type server struct {
	testgrpc.UnimplementedTestServiceServer
}

func (server) FullDuplexCall(s testgrpc.TestService_FullDuplexCallServer) error {
	for {
		if _, err := s.Recv(); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
	}
}

func measure(n int) error {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	// The broker's window settings; TLS is per connection, not per stream,
	// so it is left out.
	srv := grpc.NewServer(grpc.InitialWindowSize(1<<20), grpc.InitialConnWindowSize(16<<20))
	testgrpc.RegisterTestServiceServer(srv, server{})
	go func() { _ = srv.Serve(l) }()
	defer srv.Stop()

	before := bench.ReadUsage()
	child := exec.Command(os.Args[0], "-n", fmt.Sprint(n))
	child.Env = append(os.Environ(), childEnv+"="+l.Addr().String())
	child.Stderr = os.Stderr
	out, err := child.StdoutPipe()
	if err != nil {
		return err
	}
	if err := child.Start(); err != nil {
		return err
	}
	defer func() { _ = child.Process.Kill(); _ = child.Wait() }()
	var ready string
	if _, err := fmt.Fscan(out, &ready); err != nil || ready != "ready" {
		return fmt.Errorf("child: %q, %v", ready, err)
	}
	time.Sleep(2 * time.Second) // let the last handlers settle
	after := bench.ReadUsage()
	per := func(b, a uint64) float64 { return (float64(a) - float64(b)) / 1024 / float64(n) }
	// Comment lines, like tunnelbench's description of the run: this is
	// a floor to read the table against, not a figure of the tunnel.
	fmt.Printf("# floor: one idle grpc-go server stream (%d open, %s): heap %.1f KiB, stacks %.1f KiB, %.2f goroutines\n",
		n, runtime.Version(), per(before.Heap, after.Heap), per(before.Stacks, after.Stacks),
		(float64(after.Goroutines)-float64(before.Goroutines))/float64(n))
	return nil
}

// openStreams is the child: it opens n streams, sends one message on each
// so that every handler runs, says "ready" and waits to be killed.
func openStreams(addr string, n int) error {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithInitialWindowSize(1<<20), grpc.WithInitialConnWindowSize(16<<20))
	if err != nil {
		return err
	}
	client := testgrpc.NewTestServiceClient(conn)
	for range n {
		s, err := client.FullDuplexCall(context.Background())
		if err != nil {
			return err
		}
		if err := s.Send(&testgrpc.StreamingOutputCallRequest{}); err != nil {
			return err
		}
	}
	fmt.Println("ready")
	select {}
}
