package kcpplugin

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// reportFirst is a Dial handler that hands the dial's first message to
// firsts, establishes the tunnel and runs serve.
func reportFirst(firsts chan<- *tunnelv1.DialRequest, serve func(p *peer) error) dialHandler {
	return func(stream tunnelv1.DialService_DialServer) error {
		first, err := stream.Recv()
		if err != nil {
			return err
		}
		firsts <- first
		if err := stream.Send(established); err != nil {
			return err
		}
		return serve(&peer{stream: stream, target: first.GetTarget()})
	}
}

func TestEarlyDialReturnsBeforeTheBrokerAnswersAndSendsTheFirstWriteWithTheTarget(t *testing.T) {
	firsts := make(chan *tunnelv1.DialRequest, 1)
	answer := make(chan struct{})
	d := startBroker(t, func(stream tunnelv1.DialService_DialServer) error {
		first, err := stream.Recv()
		if err != nil {
			return err
		}
		firsts <- first
		<-answer // DialService has returned and the first Write went, unanswered
		if err := stream.Send(established); err != nil {
			return err
		}
		p := &peer{stream: stream, target: first.GetTarget()}
		if err := p.send(first.GetEarlyData()); err != nil {
			return err
		}
		return p.echo()
	})
	c := dial(t, d)
	write(t, c, []byte("client hello"))
	first := within(t, firsts, "the dial's first message")
	close(answer)
	if got := first.GetTarget().Key(); got != "root/default/webhook:443" {
		t.Errorf("target = %q, want root/default/webhook:443", got)
	}
	if got := string(first.GetEarlyData()); got != "client hello" {
		t.Errorf("early data = %q, want the first Write's bytes", got)
	}
	if got := readFull(t, c, len("client hello")); string(got) != "client hello" {
		t.Errorf("read %q, want the early data echoed", got)
	}
	write(t, c, []byte("then more"))
	if got := readFull(t, c, len("then more")); string(got) != "then more" {
		t.Errorf("read %q, want the data after it echoed", got)
	}
}

func TestEarlyDialCarriesAtMostMaxEarlyDataAndSendsTheRestAsData(t *testing.T) {
	firsts := make(chan *tunnelv1.DialRequest, 1)
	rest := make(chan []byte, 1)
	d := startBroker(t, reportFirst(firsts, func(p *peer) error {
		all, err := p.recvAll()
		rest <- all
		return err
	}))
	c := dial(t, d)
	payload := bytes.Repeat([]byte("0123456789abcdef"), 100<<10/16)
	write(t, c, payload)
	if err := c.(closeWriter).CloseWrite(); err != nil {
		t.Fatalf("CloseWrite: %v", err)
	}
	first := within(t, firsts, "the dial's first message")
	if got := len(first.GetEarlyData()); got != wire.MaxEarlyData {
		t.Errorf("early data is %d bytes, want wire.MaxEarlyData (%d)", got, wire.MaxEarlyData)
	}
	got := append(first.GetEarlyData(), within(t, rest, "the data after the early data")...)
	if !bytes.Equal(got, payload) {
		t.Errorf("the broker got %d bytes in all, not the %d written in order", len(got), len(payload))
	}
}

func TestEarlyDialThatReadsFirstSendsTheTargetAlone(t *testing.T) {
	firsts := make(chan *tunnelv1.DialRequest, 1)
	d := startBroker(t, reportFirst(firsts, func(p *peer) error {
		if err := p.send([]byte("220 ready")); err != nil {
			return err
		}
		return p.echo()
	}))
	c := dial(t, d)
	// A protocol whose server speaks first: nothing is written before the
	// first Read, which must send the dial or wait forever.
	if got := readFull(t, c, len("220 ready")); string(got) != "220 ready" {
		t.Errorf("read %q, want the server's greeting", got)
	}
	first := within(t, firsts, "the dial's first message")
	if first.GetTarget() == nil || len(first.GetEarlyData()) != 0 {
		t.Errorf("first message = %v, want the target without early data", first)
	}
}

// The codes a broker ends a dial with reach an early dial's Read and Write,
// with their messages, as DialService returns them to a dial that waits.
func TestEarlyDialFailureSurfacesOnReadAndWriteWithItsStatus(t *testing.T) {
	for _, code := range []codes.Code{codes.NotFound, codes.PermissionDenied, codes.Unavailable,
		codes.ResourceExhausted, codes.InvalidArgument, codes.DeadlineExceeded} {
		t.Run(code.String(), func(t *testing.T) {
			message := "the broker says " + strings.ToLower(code.String())
			handle := func(stream tunnelv1.DialService_DialServer) error {
				if _, err := stream.Recv(); err != nil {
					return err
				}
				return status.Error(code, message)
			}
			waited, err := waitingDialer(t, handle).DialService(context.Background(), testCluster, testNamespace, testService, testPort)
			if err == nil {
				waited.Close()
				t.Fatal("a dial that waits succeeded, want the broker's status")
			}
			checkDialStatus(t, "DialService without EarlyData", err, code, message)

			c := dial(t, startBroker(t, handle))
			if _, err := c.Write([]byte("client hello")); err != nil {
				checkDialStatus(t, "the first Write", err, code, message)
			}
			_, err = c.Read(make([]byte, 16))
			checkDialStatus(t, "Read", err, code, message)
			_, err = c.Write([]byte("more"))
			checkDialStatus(t, "Write after the failure", err, code, message)
		})
	}
}

func checkDialStatus(t *testing.T, what string, err error, code codes.Code, message string) {
	t.Helper()
	st, ok := status.FromError(err)
	if !ok || st.Code() != code || st.Message() != message {
		t.Errorf("%s: %v, want status %v %q", what, err, code, message)
	}
}

func TestEarlyDialThatTheBrokerNeverAnswersTimesOut(t *testing.T) {
	d := startBroker(t, func(stream tunnelv1.DialService_DialServer) error {
		<-stream.Context().Done()
		return stream.Context().Err()
	})
	d.Timeout = 100 * time.Millisecond
	c := dial(t, d)
	write(t, c, []byte("client hello"))
	_, err := c.Read(make([]byte, 16))
	checkDialStatus(t, "Read", err, codes.DeadlineExceeded, "dial root/default/webhook:443 timed out after 100ms")
}

// A broker that answers a dial with data, then with established, broke the
// protocol: the established after it must not undo the failure, for a dial
// that waits as for one with early data.
func TestEarlyDialAnsweredWithDataIsAProtocolError(t *testing.T) {
	handle := func(stream tunnelv1.DialService_DialServer) error {
		if _, err := stream.Recv(); err != nil {
			return err
		}
		if err := (&peer{stream: stream}).send([]byte("too soon")); err != nil {
			return err
		}
		if err := stream.Send(established); err != nil {
			return err
		}
		<-stream.Context().Done()
		return nil
	}
	const want = "protocol error: broker answered a dial with *tunnelv1.DialResponse_Data"
	waited, err := waitingDialer(t, handle).DialService(context.Background(), testCluster, testNamespace, testService, testPort)
	if err == nil {
		waited.Close()
	}
	checkDialStatus(t, "DialService without EarlyData", err, codes.Internal, want)

	c := dial(t, startBroker(t, handle))
	write(t, c, []byte("client hello"))
	_, err = c.Read(make([]byte, 16))
	checkDialStatus(t, "Read", err, codes.Internal, want)
}

func TestEarlyConnClosedBeforeUseDialsNothing(t *testing.T) {
	ended := make(chan error, 1)
	d := startBroker(t, func(stream tunnelv1.DialService_DialServer) error {
		first, err := stream.Recv()
		if err == nil {
			err = errors.New("the broker got " + first.String())
		}
		ended <- err
		return nil
	})
	c := dial(t, d)
	if err := c.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	err := within(t, ended, "the end of the stream")
	if status.Code(err) != codes.Canceled {
		t.Errorf("the broker's Recv: %v, want Canceled: a conn closed unused sends no target", err)
	}
	if _, err := c.Read(make([]byte, 1)); !errors.Is(err, net.ErrClosed) {
		t.Errorf("Read after Close: %v, want net.ErrClosed", err)
	}
	if _, err := c.Write([]byte("x")); !errors.Is(err, net.ErrClosed) && !errors.Is(err, io.EOF) {
		t.Errorf("Write after Close: %v, want net.ErrClosed", err)
	}
}
