package kcpplugin

import (
	"context"
	"errors"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// A conn's dial goes in two steps. Its target is sent with the conn's first
// Write (carrying that Write's first bytes as early data, so that a TLS
// ClientHello needs no round trip of its own), or its first Read or
// CloseWrite if one comes first. The broker then answers with established,
// or ends the stream with the dial's failure, within the dial's timeout.
// Dialer.DialService sends the target at once and waits for that answer,
// unless Dialer.EarlyData lets the conn's first Read or Write meet it.

// The outcomes of a dial. dialFailed, a dial that ended without the
// broker's OK other than by its timeout, is a dial connection's only
// (directconn.go): a Dial stream's failures end its stream instead.
const (
	dialing int32 = iota
	dialEstablished
	dialTimedOut
	dialFailed
)

// dialState is a conn's dial until the broker answers it.
type dialState struct {
	// mu guards target, and keeps the target's Send apart from Write's.
	mu sync.Mutex
	// target is what the dial names, until it is sent (or abandoned).
	target *tunnelv1.Target

	timeout time.Duration
	timer   *time.Timer // ends the dial when timeout passes unanswered
	outcome atomic.Int32
	// answered is closed when the broker has established the tunnel or the
	// dial has failed; err is the failure, set before.
	answered chan struct{}
	err      error
}

// sendTarget sends the dial's target, with up to wire.MaxEarlyData bytes of
// early as early data, if it has not gone yet; it returns how much of early
// went. A failed send is reported as Send reports it (io.EOF: the stream's
// status says why).
func (c *conn) sendTarget(early []byte) (int, error) {
	c.dial.mu.Lock()
	defer c.dial.mu.Unlock()
	if c.dial.target == nil {
		return 0, nil
	}
	early = early[:min(len(early), wire.MaxEarlyData)]
	err := c.stream.Send(&tunnelv1.DialRequest{Frame: &tunnelv1.DialRequest_Target{Target: c.dial.target}, EarlyData: early})
	c.dial.target = nil
	if err != nil {
		return 0, err
	}
	return len(early), nil
}

// abandon forgets a target that has not been sent; true if it had not.
func (d *dialState) abandon() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	unsent := d.target != nil
	d.target = nil
	return unsent
}

// waitEstablished sends the target and waits until the broker establishes
// the tunnel, the dial fails, or ctx ends; on an error the conn is done.
func (c *conn) waitEstablished(ctx context.Context) error {
	if _, err := c.sendTarget(nil); err != nil && !errors.Is(err, io.EOF) {
		c.cancel()
		<-c.received
		return err
	}
	select {
	case <-c.dial.answered:
	case <-ctx.Done():
		c.cancel()
		<-c.received
		return status.FromContextError(ctx.Err()).Err()
	}
	if c.dial.err != nil {
		<-c.received
		return c.dial.err
	}
	return nil
}

// dialTimedOut ends a dial that is still unanswered when its timeout passes.
func (c *conn) dialTimedOut() {
	if c.dial.outcome.CompareAndSwap(dialing, dialTimedOut) {
		c.cancel()
	}
}

// answer takes the broker's first message on the stream, which must be
// established.
func (r *receiver) answer(f *wire.Frame) {
	var msg tunnelv1.DialResponse
	err := f.Decode(&msg)
	f.Free()
	switch {
	case r.protocolErr != nil:
		// The stream is being cancelled for a protocol error: whatever
		// follows, an established included, changes nothing.
	case err == nil && msg.GetEstablished() != nil:
		if r.dial.outcome.CompareAndSwap(dialing, dialEstablished) {
			r.dial.timer.Stop()
			close(r.dial.answered)
		}
		// Otherwise the timeout came first and has cancelled the stream:
		// its end is the dial's failure.
	default:
		r.protocolErr = status.Errorf(codes.Internal, "protocol error: broker answered a dial with %T", msg.GetFrame())
		r.cancel()
	}
}

// dialFailure is what the end of the stream before established means: the
// dial's status, which must not be OK.
func (r *receiver) dialFailure(err error) error {
	switch {
	case r.dial.outcome.Load() == dialTimedOut:
		return status.Errorf(codes.DeadlineExceeded, "dial %s timed out after %v", r.remote, r.dial.timeout)
	case errors.Is(err, io.EOF):
		return status.Error(codes.Internal, "protocol error: broker ended a dial without answering")
	}
	return err
}

// unanswered is true until the broker has established the tunnel or the
// dial has failed.
func (d *dialState) unanswered() bool { return !isClosed(d.answered) }

// fail ends an unanswered dial with err.
func (d *dialState) fail(err error) {
	d.err = err
	close(d.answered)
}
