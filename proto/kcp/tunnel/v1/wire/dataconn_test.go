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
	"google.golang.org/protobuf/proto"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
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

func TestABindIsReadWithoutTheBytesThatFollowItEvenAByteAtATime(t *testing.T) {
	for name, wrap := range map[string]func(io.Reader) io.Reader{
		"at once":          func(r io.Reader) io.Reader { return r },
		"a byte at a time": func(r io.Reader) io.Reader { return oneByteReader{r} },
	} {
		t.Run(name, func(t *testing.T) {
			var conn bytes.Buffer
			if err := WriteBind(&conn, "4a1c0ffee000"); err != nil {
				t.Fatal(err)
			}
			conn.WriteString("next")
			session, err := ReadBind(wrap(&conn))
			if err != nil || session != "4a1c0ffee000" || conn.String() != "next" {
				t.Fatalf("ReadBind = %q, %v, rest %q", session, err, conn.String())
			}
		})
	}
}

func TestAnOrderAndItsAnswersAreReadWithoutTheBytesThatFollowThem(t *testing.T) {
	var conn bytes.Buffer
	order := &tunnelv1.DialOrder{DialId: 7, Target: &tunnelv1.Target{Cluster: "root", Namespace: "default", Service: "webhook", Port: 443},
		TimeoutMs: 5000, EarlyData: bytes.Repeat([]byte("h"), MaxEarlyData)}
	if err := WriteOrder(&conn, order); err != nil {
		t.Fatal(err)
	}
	if err := WriteAnswer(&conn, nil); err != nil {
		t.Fatal(err)
	}
	if err := WriteAnswer(&conn, status.Error(codes.NotFound, "no Service default/webhook")); err != nil {
		t.Fatal(err)
	}
	conn.WriteString("tunnel")
	got, err := ReadOrder(&conn)
	if err != nil || !proto.Equal(got, order) {
		t.Fatalf("ReadOrder = %v, %v", got, err)
	}
	if err := ReadAnswer(&conn); err != nil {
		t.Fatalf("an OK answer read as %v", err)
	}
	err = ReadAnswer(&conn)
	if status.Code(err) != codes.NotFound || status.Convert(err).Message() != "no Service default/webhook" {
		t.Fatalf("a failure read as %v", err)
	}
	if conn.String() != "tunnel" {
		t.Fatalf("after the answers the connection holds %q", conn.String())
	}
}

func TestOpenResultsCarryTheRefusalsStatus(t *testing.T) {
	var conn bytes.Buffer
	if err := WriteOpenResult(&conn, status.Error(codes.NotFound, "no registration of this agent")); err != nil {
		t.Fatal(err)
	}
	long := strings.Repeat("m", 4096)
	if err := WriteOpenResult(&conn, status.Error(codes.ResourceExhausted, long)); err != nil {
		t.Fatal(err)
	}
	conn.WriteString("tunnel")
	_, err := ReadAccepted(&conn)
	if status.Code(err) != codes.NotFound || status.Convert(err).Message() != "no registration of this agent" {
		t.Fatalf("refusal read as %v", err)
	}
	_, err = ReadAccepted(&conn)
	if status.Code(err) != codes.ResourceExhausted || !strings.HasPrefix(long, status.Convert(err).Message()) {
		t.Fatalf("a long refusal read as %v", err)
	}
	if conn.String() != "tunnel" {
		t.Fatalf("after the results the connection holds %q", conn.String())
	}
}

func TestMalformedMessagesAreTheirSendersMistake(t *testing.T) {
	for name, raw := range map[string][]byte{
		"too large":       {0xff, 0xff, 0x03},
		"not protobuf":    {3, 0xff, 0xff, 0xff},
		"length overflow": {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01},
	} {
		t.Run(name, func(t *testing.T) {
			// The agent's bind and answer: its protocol error.
			if _, err := ReadBind(bytes.NewReader(raw)); status.Code(err) != codes.InvalidArgument {
				t.Errorf("ReadBind = %v, want InvalidArgument", err)
			}
			if err := ReadAnswer(bytes.NewReader(raw)); !errors.Is(err, ErrBadAnswer) {
				t.Errorf("ReadAnswer = %v, want ErrBadAnswer", err)
			}
			// The broker's order: its mistake, as its answers' are.
			if _, err := ReadOrder(bytes.NewReader(raw)); status.Code(err) != codes.Internal {
				t.Errorf("ReadOrder = %v, want Internal", err)
			}
		})
	}
	if _, err := ReadBind(bytes.NewReader([]byte{0})); status.Code(err) != codes.InvalidArgument {
		t.Errorf("a bind without a session: %v, want InvalidArgument", err)
	}
}

func TestAConnectionThatEndsSaysWhere(t *testing.T) {
	if _, err := ReadBind(bytes.NewReader(nil)); !errors.Is(err, io.EOF) {
		t.Errorf("an empty connection: %v, want io.EOF", err)
	}
	var conn bytes.Buffer
	if err := WriteBind(&conn, "4a1c0ffee000"); err != nil {
		t.Fatal(err)
	}
	cut := conn.Bytes()[:conn.Len()-1]
	if _, err := ReadBind(bytes.NewReader(cut)); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Errorf("a connection cut inside the bind: %v, want io.ErrUnexpectedEOF", err)
	}
	if _, err := ReadOrder(bytes.NewReader(nil)); !errors.Is(err, io.EOF) {
		t.Errorf("no order: %v, want io.EOF", err)
	}
	if err := ReadAnswer(bytes.NewReader(nil)); !errors.Is(err, io.EOF) {
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
