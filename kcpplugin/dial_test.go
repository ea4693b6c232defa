package kcpplugin

import (
	"context"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

func TestDialSendsTargetAndReturnsUsableConn(t *testing.T) {
	targets := make(chan *tunnelv1.Target, 1)
	d := waitingDialer(t, establish(func(p *peer) error {
		targets <- p.target
		return p.echo()
	}))
	c, err := d.DialService(context.Background(), "1x2y3z4w5v6u7t8s", "kube-system", "my-webhook", 8443)
	if err != nil {
		t.Fatalf("DialService: %v", err)
	}
	defer c.Close()

	got := within(t, targets, "the target")
	if got.GetCluster() != "1x2y3z4w5v6u7t8s" || got.GetNamespace() != "kube-system" ||
		got.GetService() != "my-webhook" || got.GetPort() != 8443 {
		t.Errorf("broker got target %v, want 1x2y3z4w5v6u7t8s/kube-system/my-webhook:8443", got)
	}
	if got, want := c.RemoteAddr().String(), "1x2y3z4w5v6u7t8s/kube-system/my-webhook:8443"; got != want {
		t.Errorf("RemoteAddr = %q, want %q", got, want)
	}
	if c.RemoteAddr().Network() == "" || c.LocalAddr() == nil || c.LocalAddr().Network() == "" {
		t.Errorf("addresses are incomplete: local %v, remote %v", c.LocalAddr(), c.RemoteAddr())
	}

	write(t, c, []byte("ping"))
	if got := readFull(t, c, 4); string(got) != "ping" {
		t.Errorf("echo = %q, want ping", got)
	}
}

func TestDialAcceptsSystemClusters(t *testing.T) {
	d := startTunnels(t, func(p *peer) error { return p.echo() })
	c, err := d.DialService(context.Background(), "system:admin", "default", "svc", 1)
	if err != nil {
		t.Fatalf("DialService: %v", err)
	}
	c.Close()
}

// noServer fails the test if the dialer contacts the broker at all.
type noServer struct{ t *testing.T }

func (n noServer) Invoke(context.Context, string, any, any, ...grpc.CallOption) error {
	n.t.Error("Invoke called: the dialer contacted the broker")
	return status.Error(codes.Internal, "unexpected call")
}

func (n noServer) NewStream(context.Context, *grpc.StreamDesc, string, ...grpc.CallOption) (grpc.ClientStream, error) {
	n.t.Error("NewStream called: the dialer contacted the broker")
	return nil, status.Error(codes.Internal, "unexpected call")
}

func TestDialRejectsInvalidTargetsWithoutContactingBroker(t *testing.T) {
	tests := []struct {
		name                        string
		cluster, namespace, service string
		port                        int32
	}{
		{"upper-case cluster", "Root", "default", "svc", 443},
		{"cluster path", "root:org", "default", "svc", 443},
		{"empty cluster", "", "default", "svc", 443},
		{"one-character cluster", "r", "default", "svc", 443},
		{"namespace starts with a dash", "root", "-x", "svc", 443},
		{"empty namespace", "root", "", "svc", 443},
		{"namespace with a dot", "root", "a.b", "svc", 443},
		{"service starts with a digit", "root", "default", "9svc", 443},
		{"empty service", "root", "default", "", 443},
		{"service too long", "root", "default", strings.Repeat("s", 64), 443},
		{"port 0", "root", "default", "svc", 0},
		{"port 70000", "root", "default", "svc", 70000},
		{"port -1", "root", "default", "svc", -1},
		{"port 65536", "root", "default", "svc", 65536},
	}
	d := NewDialer(noServer{t})
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := d.DialService(context.Background(), tt.cluster, tt.namespace, tt.service, tt.port)
			if err == nil {
				c.Close()
				t.Fatal("DialService succeeded, want InvalidArgument")
			}
			if c != nil {
				t.Errorf("DialService returned a conn with its error")
			}
			if got := status.Code(err); got != codes.InvalidArgument {
				t.Errorf("status code = %v, want InvalidArgument (error: %v)", got, err)
			}
		})
	}
}

func TestDialReturnsBrokerStatus(t *testing.T) {
	for _, code := range []codes.Code{codes.NotFound, codes.Unavailable, codes.PermissionDenied, codes.ResourceExhausted, codes.DeadlineExceeded} {
		t.Run(code.String(), func(t *testing.T) {
			d := waitingDialer(t, func(stream tunnelv1.DialService_DialServer) error {
				if _, err := stream.Recv(); err != nil {
					return err
				}
				return status.Error(code, "no luck")
			})
			c, err := d.DialService(context.Background(), testCluster, testNamespace, testService, testPort)
			if err == nil {
				c.Close()
				t.Fatalf("DialService succeeded, want %v", code)
			}
			if got := status.Code(err); got != code {
				t.Errorf("status code = %v, want %v (error: %v)", got, code, err)
			}
			if got := status.Convert(err).Message(); got != "no luck" {
				t.Errorf("status message = %q, want the broker's", got)
			}
		})
	}
}

func TestDialFailsWhenBrokerNeverAnswers(t *testing.T) {
	handlerDone := make(chan error, 1)
	d := waitingDialer(t, func(stream tunnelv1.DialService_DialServer) error {
		if _, err := stream.Recv(); err != nil {
			return err
		}
		<-stream.Context().Done() // never answer
		handlerDone <- stream.Context().Err()
		return nil
	})
	d.Timeout = 200 * time.Millisecond

	c, err := d.DialService(context.Background(), testCluster, testNamespace, testService, testPort)
	if err == nil {
		c.Close()
		t.Fatal("DialService succeeded against a broker that never answers")
	}
	if got := status.Code(err); got != codes.DeadlineExceeded {
		t.Errorf("status code = %v, want DeadlineExceeded (error: %v)", got, err)
	}
	// The abandoned stream is cancelled, so the broker can let go of it.
	if err := within(t, handlerDone, "the broker's handler to see the cancellation"); err == nil {
		t.Error("handler ended without a cancelled context")
	}
}

func TestDialHonoursCallerDeadline(t *testing.T) {
	d := waitingDialer(t, func(stream tunnelv1.DialService_DialServer) error {
		<-stream.Context().Done() // never answer
		return nil
	})
	d.Timeout = time.Hour
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	c, err := d.DialService(ctx, testCluster, testNamespace, testService, testPort)
	if err == nil {
		c.Close()
		t.Fatal("DialService succeeded against a broker that never answers")
	}
	if got := status.Code(err); got != codes.DeadlineExceeded {
		t.Errorf("status code = %v, want DeadlineExceeded (error: %v)", got, err)
	}
}

func TestDialCancelled(t *testing.T) {
	received := make(chan struct{}, 1)
	d := waitingDialer(t, func(stream tunnelv1.DialService_DialServer) error {
		if _, err := stream.Recv(); err != nil {
			return err
		}
		received <- struct{}{}
		<-stream.Context().Done() // never answer
		return nil
	})

	t.Run("while waiting for the broker", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		done := make(chan error, 1)
		go func() {
			c, err := d.DialService(ctx, testCluster, testNamespace, testService, testPort)
			if err == nil {
				c.Close()
			}
			done <- err
		}()
		within(t, received, "the broker to get the target")
		cancel()
		err := within(t, done, "DialService to return after cancel")
		if got := status.Code(err); got != codes.Canceled {
			t.Errorf("status code = %v, want Canceled (error: %v)", got, err)
		}
	})

	t.Run("before the call", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		c, err := d.DialService(ctx, testCluster, testNamespace, testService, testPort)
		if err == nil {
			c.Close()
			t.Fatal("DialService succeeded with a cancelled context")
		}
		if got := status.Code(err); got != codes.Canceled {
			t.Errorf("status code = %v, want Canceled (error: %v)", got, err)
		}
	})
}

func TestNewDialerBoundsDialsByDefaultDialTimeoutAndSendsEarlyData(t *testing.T) {
	d := NewDialer(noServer{t})
	if d.Timeout != DefaultDialTimeout {
		t.Errorf("Timeout = %v, want DefaultDialTimeout", d.Timeout)
	}
	if !d.EarlyData {
		t.Error("EarlyData is off, want it on by default")
	}
}

// The stream outlives the dial's context: Go's HTTP transport may cancel the
// dial context once the connection is handed over.
func TestConnOutlivesDialContext(t *testing.T) {
	d := startTunnels(t, func(p *peer) error { return p.echo() })
	ctx, cancel := context.WithCancel(context.Background())
	c, err := d.DialService(ctx, testCluster, testNamespace, testService, testPort)
	if err != nil {
		t.Fatalf("DialService: %v", err)
	}
	defer c.Close()
	cancel()
	// Give a wrongly tied stream time to die.
	time.Sleep(100 * time.Millisecond)

	write(t, c, []byte("still here"))
	if got := readFull(t, c, 10); string(got) != "still here" {
		t.Errorf("echo = %q", got)
	}
	closeWrite(t, c)
	if n, err := c.Read(make([]byte, 1)); n != 0 || !errors.Is(err, io.EOF) {
		t.Errorf("Read after echo ended = %d, %v; want io.EOF", n, err)
	}
}

func TestDialProtocolErrors(t *testing.T) {
	tests := []struct {
		name   string
		handle dialHandler
	}{
		{"data before established", func(stream tunnelv1.DialService_DialServer) error {
			if _, err := stream.Recv(); err != nil {
				return err
			}
			if err := stream.Send(&tunnelv1.DialResponse{Frame: &tunnelv1.DialResponse_Data{Data: []byte("x")}}); err != nil {
				return err
			}
			<-stream.Context().Done()
			return nil
		}},
		{"close_write before established", func(stream tunnelv1.DialService_DialServer) error {
			if _, err := stream.Recv(); err != nil {
				return err
			}
			if err := stream.Send(&tunnelv1.DialResponse{Frame: &tunnelv1.DialResponse_CloseWrite{CloseWrite: &tunnelv1.CloseWrite{}}}); err != nil {
				return err
			}
			<-stream.Context().Done()
			return nil
		}},
		{"OK without an answer", func(stream tunnelv1.DialService_DialServer) error {
			_, err := stream.Recv()
			return err
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := waitingDialer(t, tt.handle)
			c, err := d.DialService(context.Background(), testCluster, testNamespace, testService, testPort)
			if err == nil {
				c.Close()
				t.Fatal("DialService succeeded")
			}
			if got := status.Code(err); got != codes.Internal {
				t.Errorf("status code = %v, want Internal (error: %v)", got, err)
			}
		})
	}
}

func TestAFailedDialReturnsANilConn(t *testing.T) {
	cc, err := grpc.NewClient("passthrough:///127.0.0.1:1", grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	cc.Close() // every stream on it fails at once
	for _, early := range []bool{true, false} {
		d := NewDialer(cc)
		d.EarlyData = early
		c, err := d.DialService(context.Background(), "root", "default", "webhook", 443)
		if err == nil || c != nil {
			t.Errorf("early data %v: DialService on a closed connection gave %#v, %v; want a nil net.Conn and an error", early, c, err)
		}
	}
}
