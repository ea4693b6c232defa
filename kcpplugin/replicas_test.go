package kcpplugin

import (
	"bytes"
	"context"
	"io"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// freeAddr is a loopback address with no broker on it (yet).
func freeAddr(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	return lis.Addr().String()
}

// notHere is a replica that no agent of the dial's cluster has joined: it
// refuses every dial as the broker does, before ordering anything.
func notHere(dials *atomic.Int32) dialHandler {
	return func(stream tunnelv1.DialService_DialServer) error {
		dials.Add(1)
		if _, err := stream.Recv(); err != nil {
			return err
		}
		return status.Error(codes.Unavailable, `no agent serves logical cluster "root"`)
	}
}

// echoing establishes every dial and echoes, counting them.
func echoing(dials *atomic.Int32) dialHandler {
	return establish(func(p *peer) error {
		dials.Add(1)
		return p.echo()
	})
}

// echoOnceThrough dials, writes, and reads the echo back.
func echoOnceThrough(t *testing.T, d *Dialer) {
	t.Helper()
	c, err := d.DialService(context.Background(), testCluster, testNamespace, testService, testPort)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	defer c.Close()
	write(t, c, []byte("ping"))
	closeWrite(t, c)
	got, err := io.ReadAll(c)
	if err != nil || string(got) != "ping" {
		t.Fatalf("echo: %q, %v; want ping", got, err)
	}
}

func TestADialThatAReplicaCannotServeIsSentToAnotherReplica(t *testing.T) {
	certs := selfSignedMTLS(t)
	var refused, served atomic.Int32
	bare := serveReplica(t, certs, notHere(&refused))
	good := serveReplica(t, certs, echoing(&served))
	dialer := newTestClient(t, "replicas:///broker", certs, grpc.WithResolvers(replicas(bare, good)))

	// Until both replicas are connected, round robin may send every dial to
	// the good one; the dials go on until one has been refused.
	deadline := time.Now().Add(waitLong)
	for n := 1; refused.Load() == 0; n++ {
		if time.Now().After(deadline) {
			t.Fatal("no dial reached the replica without an agent")
		}
		echoOnceThrough(t, dialer)
		if served.Load() != int32(n) {
			t.Fatalf("after %d dials, %d reached a target, want each exactly once", n, served.Load())
		}
	}
}

// gRPC retries a dial on another replica only while all it sent fits its
// retry buffer (256 KiB): a caller that writes more before the broker
// answers must still have its dial retried. Nothing but the early data
// leaves before the answer.
func TestADialStaysRetryableWhateverTheCallerWritesBeforeTheAnswer(t *testing.T) {
	certs := selfSignedMTLS(t)
	var refused, served atomic.Int32
	// The replica takes its time to refuse, as one whose agents are busy
	// does, and has the broker's stream window (1 MiB): time and room for
	// a caller that did not wait to send it all.
	refuse := notHere(&refused)
	bare := serveDialService(t, func(stream tunnelv1.DialService_DialServer) error {
		time.Sleep(200 * time.Millisecond)
		return refuse(stream)
	}, grpc.Creds(credentials.NewTLS(certs.server)), grpc.InitialWindowSize(wire.WindowSize), grpc.InitialConnWindowSize(wire.ConnWindowSize))
	good := serveReplica(t, certs, echoing(&served))
	dialer := newTestClient(t, "replicas:///broker", certs, grpc.WithResolvers(replicas(bare, good)))
	payload := bytes.Repeat([]byte("0123456789abcdef"), 512<<10/16)

	deadline := time.Now().Add(waitLong)
	for n := 1; refused.Load() == 0; n++ {
		if time.Now().After(deadline) {
			t.Fatal("no dial reached the replica without an agent")
		}
		c, err := dialer.DialService(context.Background(), testCluster, testNamespace, testService, testPort)
		if err != nil {
			t.Fatalf("dial %d: %v", n, err)
		}
		wrote := make(chan error, 1)
		go func() {
			_, err := c.Write(payload)
			if err == nil {
				err = c.(closeWriter).CloseWrite()
			}
			wrote <- err
		}()
		got, err := io.ReadAll(c)
		c.Close()
		if werr := <-wrote; werr != nil || err != nil || !bytes.Equal(got, payload) {
			t.Fatalf("dial %d: write: %v; read %d bytes: %v; want the %d written, echoed", n, werr, len(got), err, len(payload))
		}
	}
}

func TestADialThatMayHaveReachedItsTargetIsNotRetried(t *testing.T) {
	certs := selfSignedMTLS(t)
	var dials atomic.Int32
	// As the broker says of a dial whose early data reached the target.
	reached := serveReplica(t, certs, func(stream tunnelv1.DialService_DialServer) error {
		dials.Add(1)
		if _, err := stream.Recv(); err != nil {
			return err
		}
		stream.SetTrailer(metadata.Pairs("grpc-retry-pushback-ms", "-1"))
		return status.Error(codes.Unavailable, "agent a: connection reset")
	})
	dialer := newTestClient(t, "replicas:///broker", certs, grpc.WithResolvers(replicas(reached)))
	dialer.EarlyData = false
	_, err := dialer.DialService(context.Background(), testCluster, testNamespace, testService, testPort)
	checkDialStatus(t, "dial", err, codes.Unavailable, "agent a: connection reset")
	if n := dials.Load(); n != 1 {
		t.Errorf("the broker saw the dial %d times, want once", n)
	}
}

func TestADialWaitsForABrokerThatStartsWithinItsTimeout(t *testing.T) {
	certs := selfSignedMTLS(t)
	addr := freeAddr(t)
	dialer := newTestClient(t, "replicas:///broker", certs, grpc.WithResolvers(replicas(addr)))
	dialer.Timeout = waitLong
	var served atomic.Int32
	dialed := make(chan error, 1)
	go func() {
		c, err := dialer.DialService(context.Background(), testCluster, testNamespace, testService, testPort)
		if err == nil {
			write(t, c, []byte("ping"))
			closeWrite(t, c)
			var got []byte
			got, err = io.ReadAll(c)
			if err == nil && string(got) != "ping" {
				err = io.ErrUnexpectedEOF
			}
			c.Close()
		}
		dialed <- err
	}()
	// The dial waits, however many connection attempts fail meanwhile.
	stillBlocked(t, dialed, 300*time.Millisecond, "a dial with no broker")

	lis, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.Creds(credentials.NewTLS(certs.server)))
	tunnelv1.RegisterDialServiceServer(srv, &fakeBroker{handle: echoing(&served)})
	go srv.Serve(lis)
	defer srv.Stop()
	if err := within(t, dialed, "the dial, once the broker is up"); err != nil {
		t.Fatalf("dial: %v", err)
	}
}

func TestADialThatFindsNoBrokerInItsTimeoutSaysWhy(t *testing.T) {
	certs := selfSignedMTLS(t)
	gone := freeAddr(t)
	dialer := newTestClient(t, "replicas:///broker", certs, grpc.WithResolvers(replicas(gone)))
	dialer.Timeout = 500 * time.Millisecond
	_, err := dialer.DialService(context.Background(), testCluster, testNamespace, testService, testPort)
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "no tunnel broker reachable within 50") ||
		!strings.Contains(err.Error(), "connection refused") {
		t.Fatalf("dial: %v, want Unavailable: no tunnel broker reachable within 500ms or so, with the last connection error", err)
	}
	// kcp shows it to its end users: words, not the broker's address.
	if _, port, _ := net.SplitHostPort(gone); strings.Contains(err.Error(), "127.0.0.1") || strings.Contains(err.Error(), ":"+port) {
		t.Errorf("dial: %v names the broker's address %s", err, gone)
	}
}

func TestADialThatNoReplicaCanServeFailsWithTheReplicasStatus(t *testing.T) {
	certs := selfSignedMTLS(t)
	var refused atomic.Int32
	dialer := newTestClient(t, "replicas:///broker", certs, grpc.WithResolvers(replicas(serveReplica(t, certs, notHere(&refused)))))
	c, err := dialer.DialService(context.Background(), testCluster, testNamespace, testService, testPort)
	if err == nil {
		if _, err = c.Write([]byte("hello")); err == nil {
			_, err = c.Read(make([]byte, 1))
		}
		c.Close()
	}
	// Not "max retries exhausted: ...": kcp shows this message to its users.
	checkDialStatus(t, "dial", err, codes.Unavailable, `no agent serves logical cluster "root"`)
	if n := refused.Load(); n != 5 {
		t.Errorf("the replica refused the dial %d times, want 5 (gRPC's most attempts)", n)
	}
}

func TestADialWhoseDeadlineComesFirstSaysWhyNoBrokerWasReady(t *testing.T) {
	certs := selfSignedMTLS(t)
	dialer := newTestClient(t, "replicas:///broker", certs, grpc.WithResolvers(replicas(freeAddr(t))))
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err := dialer.DialService(ctx, testCluster, testNamespace, testService, testPort)
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "no tunnel broker reachable") ||
		!strings.Contains(err.Error(), "connection refused") {
		t.Fatalf("dial: %v, want Unavailable: no tunnel broker reachable, with the last connection error", err)
	}
}
