package kcpplugin

import (
	"errors"
	"net"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// failAfter is a broker that sends frames and then ends the tunnel with err.
func failAfter(err error, frames ...string) func(p *peer) error {
	return func(p *peer) error {
		for _, f := range frames {
			if err := p.send([]byte(f)); err != nil {
				return err
			}
		}
		return err
	}
}

// writeUntilError writes until Write fails, at most limit bytes, in a
// goroutine.
func writeUntilError(c net.Conn, limit int) <-chan result {
	ch := make(chan result, 1)
	go func() {
		chunk := make([]byte, wire.MaxFrame)
		written := 0
		for written < limit {
			n, err := c.Write(chunk)
			written += n
			if err != nil {
				ch <- result{n: written, err: err}
				return
			}
		}
		ch <- result{n: written}
	}()
	return ch
}

func TestPeerFailureAfterData(t *testing.T) {
	c := dial(t, startTunnels(t, failAfter(status.Error(codes.Unavailable, "agent gone"), "par", "tial")))

	// Data sent before the failure is delivered, then the status.
	r := within(t, goReadAll(c), "reading to the failure")
	if string(r.data) != "partial" {
		t.Errorf("read %q before the failure, want %q", r.data, "partial")
	}
	if status.Code(r.err) != codes.Unavailable {
		t.Fatalf("Read error = %v, want status Unavailable", r.err)
	}
	// The failure is sticky, for writes too.
	if _, err := c.Read(make([]byte, 1)); status.Code(err) != codes.Unavailable {
		t.Errorf("second Read error = %v, want status Unavailable", err)
	}
	w := within(t, writeUntilError(c, 1<<30), "Write to fail")
	if status.Code(w.err) != codes.Unavailable {
		t.Errorf("Write error = %v, want status Unavailable", w.err)
	}
}

// A Write to a tunnel that failed returns the failure even if nobody reads
// the data that arrived before it (a write-then-read caller would deadlock
// otherwise), and the data is still there to read afterwards.
func TestWriteToFailedPeerWithoutReader(t *testing.T) {
	c := dial(t, startTunnels(t, failAfter(status.Error(codes.Unavailable, "agent gone"), "last ", "words")))

	w := within(t, writeUntilError(c, 1<<30), "Write to fail while nobody reads")
	if status.Code(w.err) != codes.Unavailable {
		t.Errorf("Write error = %v, want status Unavailable", w.err)
	}
	if n, err := c.Write([]byte("x")); n != 0 || status.Code(err) != codes.Unavailable {
		t.Errorf("second Write = %d, %v; want the same failure", n, err)
	}
	r := within(t, goReadAll(c), "reading after the failed Write")
	if string(r.data) != "last words" || status.Code(r.err) != codes.Unavailable {
		t.Errorf("read %q, %v; want %q and status Unavailable", r.data, r.err, "last words")
	}
	receiveDone(t, c)
}

// A failure after the broker's close_write does not take back the EOF, but
// a Write learns of it.
func TestPeerFailureAfterCloseWrite(t *testing.T) {
	c := dial(t, startTunnels(t, func(p *peer) error {
		if err := p.send([]byte("all")); err != nil {
			return err
		}
		if err := p.closeWrite(); err != nil {
			return err
		}
		return status.Error(codes.Unavailable, "agent gone")
	}))
	r := within(t, goReadAll(c), "reading to the end")
	if r.err != nil || string(r.data) != "all" {
		t.Errorf("read %q, %v; want %q and EOF", r.data, r.err, "all")
	}
	w := within(t, writeUntilError(c, 1<<30), "Write to fail")
	if status.Code(w.err) != codes.Unavailable {
		t.Errorf("Write error = %v, want status Unavailable", w.err)
	}
}

// A broker that ends the stream without close_write still means EOF.
func TestPeerEndsWithoutCloseWrite(t *testing.T) {
	c := dial(t, startTunnels(t, failAfter(nil, "done")))
	r := within(t, goReadAll(c), "reading to the end")
	if r.err != nil || string(r.data) != "done" {
		t.Errorf("read %q, %v; want %q and EOF", r.data, r.err, "done")
	}
	receiveDone(t, c)
	w := within(t, writeUntilError(c, 1<<30), "Write to an ended stream to fail")
	if w.err == nil || errors.Is(w.err, net.ErrClosed) {
		// net.ErrClosed would tell the caller it closed the conn itself.
		t.Errorf("Write to an ended stream = %v; want an error other than net.ErrClosed", w.err)
	}
}

func TestProtocolErrorsAbortTunnel(t *testing.T) {
	established := &tunnelv1.DialResponse{Frame: &tunnelv1.DialResponse_Established{Established: &tunnelv1.Established{}}}
	data := &tunnelv1.DialResponse{Frame: &tunnelv1.DialResponse_Data{Data: []byte("late")}}
	closeWrite := &tunnelv1.DialResponse{Frame: &tunnelv1.DialResponse_CloseWrite{CloseWrite: &tunnelv1.CloseWrite{}}}
	tests := []struct {
		name    string
		frames  []*tunnelv1.DialResponse
		readErr func(error) bool
	}{
		{"second established", []*tunnelv1.DialResponse{established},
			func(err error) bool { return status.Code(err) == codes.Internal }},
		{"empty frame", []*tunnelv1.DialResponse{{}},
			func(err error) bool { return status.Code(err) == codes.Internal }},
		{"data after close_write", []*tunnelv1.DialResponse{closeWrite, data},
			func(err error) bool { return err == nil }}, // EOF, as ReadAll reports it
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cancelled := make(chan error, 1)
			// The dial waits for established, so that the frames after it
			// are the tunnel's.
			c := dial(t, waitingDialer(t, establish(func(p *peer) error {
				for _, f := range tt.frames {
					if err := p.stream.Send(f); err != nil {
						return err
					}
				}
				<-p.ctx().Done()
				cancelled <- p.ctx().Err()
				return nil
			})))
			// The caller gives up on a broken broker: the broker sees it.
			within(t, cancelled, "the broker to see the tunnel aborted")

			r := within(t, goReadAll(c), "reading to the error")
			if r.n != 0 || !tt.readErr(r.err) {
				t.Errorf("read %q, %v", r.data, r.err)
			}
			w := within(t, writeUntilError(c, 1<<30), "Write to fail")
			if status.Code(w.err) != codes.Internal {
				t.Errorf("Write error = %v, want status Internal", w.err)
			}
		})
	}
}
