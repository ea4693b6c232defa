package wire

import (
	"bytes"
	"context"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// oneByteReader hands out one byte per Read, as a slow peer would, and
// counts what was asked of it.
type oneByteReader struct{ r io.Reader }

func (o oneByteReader) Read(p []byte) (int, error) {
	if len(p) > 1 {
		p = p[:1]
	}
	return o.r.Read(p)
}

func TestOpenIsReadWithoutTheBytesThatFollowIt(t *testing.T) {
	var conn bytes.Buffer
	if err := WriteOpen(&conn, 0xfedcba9876543210); err != nil {
		t.Fatal(err)
	}
	conn.WriteString("ClientHello")
	id, err := ReadOpen(&conn)
	if err != nil || id != 0xfedcba9876543210 {
		t.Fatalf("ReadOpen = %x, %v", id, err)
	}
	if rest := conn.String(); rest != "ClientHello" {
		t.Fatalf("after the open the connection holds %q, want the tunnel's bytes", rest)
	}
}

func TestOpenSentAByteAtATimeIsRead(t *testing.T) {
	var conn bytes.Buffer
	if err := WriteOpen(&conn, 7); err != nil {
		t.Fatal(err)
	}
	conn.WriteString("x")
	id, err := ReadOpen(oneByteReader{&conn})
	if err != nil || id != 7 || conn.String() != "x" {
		t.Fatalf("ReadOpen = %d, %v, rest %q", id, err, conn.String())
	}
}

func TestOpenResultsCarryTheRefusalsStatus(t *testing.T) {
	var conn bytes.Buffer
	if err := WriteOpenResult(&conn, nil); err != nil {
		t.Fatal(err)
	}
	if err := WriteOpenResult(&conn, status.Error(codes.NotFound, "dial 7 is not pending for this agent")); err != nil {
		t.Fatal(err)
	}
	long := strings.Repeat("m", 4096)
	if err := WriteOpenResult(&conn, status.Error(codes.ResourceExhausted, long)); err != nil {
		t.Fatal(err)
	}
	conn.WriteString("tunnel")
	if err := ReadOpenResult(&conn); err != nil {
		t.Fatalf("OK result read as %v", err)
	}
	err := ReadOpenResult(&conn)
	if status.Code(err) != codes.NotFound || status.Convert(err).Message() != "dial 7 is not pending for this agent" {
		t.Fatalf("refusal read as %v", err)
	}
	err = ReadOpenResult(&conn)
	if status.Code(err) != codes.ResourceExhausted || !strings.HasPrefix(long, status.Convert(err).Message()) {
		t.Fatalf("a long refusal read as %v", err)
	}
	if conn.String() != "tunnel" {
		t.Fatalf("after the results the connection holds %q", conn.String())
	}
}

func TestMalformedOpensAreInvalidArgument(t *testing.T) {
	for name, raw := range map[string][]byte{
		"too large":       {0xff, 0xff, 0x03},
		"not protobuf":    {3, 0xff, 0xff, 0xff},
		"not an open":     {2, 0x12, 0x00}, // TunnelRequest{data: ""}
		"length overflow": {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01},
	} {
		_, err := ReadOpen(bytes.NewReader(raw))
		if status.Code(err) != codes.InvalidArgument {
			t.Errorf("%s: ReadOpen = %v, want InvalidArgument", name, err)
		}
	}
}

func TestAConnectionThatEndsSaysWhere(t *testing.T) {
	if _, err := ReadOpen(bytes.NewReader(nil)); !errors.Is(err, io.EOF) {
		t.Errorf("an empty connection: %v, want io.EOF", err)
	}
	var conn bytes.Buffer
	if err := WriteOpen(&conn, 1<<40); err != nil {
		t.Fatal(err)
	}
	cut := conn.Bytes()[:conn.Len()-1]
	if _, err := ReadOpen(bytes.NewReader(cut)); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Errorf("a connection cut inside the open: %v, want io.ErrUnexpectedEOF", err)
	}
	if err := ReadOpenResult(bytes.NewReader(nil)); !errors.Is(err, io.EOF) {
		t.Errorf("no answer: %v, want io.EOF", err)
	}
}

func TestTheAcceptNamesTheReplicaAndARefusalItsStatus(t *testing.T) {
	var conn bytes.Buffer
	if err := WriteAccepted(&conn, "broker-1"); err != nil {
		t.Fatal(err)
	}
	if err := WriteOpenResult(&conn, status.Error(codes.ResourceExhausted, "too many spares")); err != nil {
		t.Fatal(err)
	}
	if id, err := ReadAccepted(&conn); err != nil || id != "broker-1" {
		t.Fatalf("ReadAccepted = %q, %v", id, err)
	}
	if _, err := ReadAccepted(&conn); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a refused spare read as %v", err)
	}
}

func TestAwaitingTheAcceptEndsWithItsContext(t *testing.T) {
	_, peer := tcpPair(t)
	sock := &Socket{Conn: peer}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := AwaitAccepted(ctx, sock, sock)
		done <- err
	}()
	// A broker that never answers: the pool's close ends the wait at once,
	// without the handshake timeout.
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("the wait ended with %v, want context.Canceled", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the cancelled wait for the accept did not end")
	}
}

func TestAnAcceptWithinTheContextIsTheAccept(t *testing.T) {
	broker, peer := tcpPair(t)
	if err := WriteAccepted(broker, "broker-1"); err != nil {
		t.Fatal(err)
	}
	sock := &Socket{Conn: peer}
	if id, err := AwaitAccepted(context.Background(), sock, sock); err != nil || id != "broker-1" {
		t.Fatalf("AwaitAccepted = %q, %v; want broker-1", id, err)
	}
}
