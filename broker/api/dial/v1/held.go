package dial

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/broker/admission"
	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
	"github.com/kcp-dev/tunnel-broker/internal/splice"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// held reads what a caller sends after its target while the dial is
// pending, and holds it for the tunnel (docs/protocol.md §3.4).
//
// Left unread, those frames would wait in the stream's flow-control
// window, 1 MiB that no quota counts, for as long as the dial is pending.
// Read, they count against the caller's early data, each frame as at
// least minHeldFrame, and a caller may send no more than an early data's
// worth before established, its early data included: more refuses the
// dial. grpcurl's -d sends a dial's target and its data at once, so the
// broker cannot refuse data before established altogether.
//
// One goroutine reads the stream while the dial is pending. Once it is
// answered, the tunnel's caller leg (leg) gives the splice the frames it
// held first, then the receive that was in flight at the answer, and
// reads the stream itself from then on.
type held struct {
	stream grpc.ServerStream
	ticket *admission.Ticket
	// refuse ends the pending dial with the reason the reader refused it.
	refuse context.CancelCauseFunc

	mu       sync.Mutex
	frames   []wire.Frame
	releases []func() // of the frames' bytes, counted as early data
	room     int      // what the caller may still send, counted as hold counts it
	// end is what ended the reader before the answer: the caller's
	// half-close (io.EOF), a failure of the stream, or the refusal.
	end      error
	answered bool
	// last takes the receive in flight when the dial was answered.
	last chan received
}

// received is what a receive from the stream brought.
type received struct {
	f   wire.Frame
	err error
}

// holdUntilAnswered starts reading stream for a dial whose early data took
// sent bytes; refuse ends the dial.
func holdUntilAnswered(stream grpc.ServerStream, ticket *admission.Ticket, sent int, refuse context.CancelCauseFunc) *held {
	h := &held{stream: stream, ticket: ticket, refuse: refuse, room: wire.MaxEarlyData - sent, last: make(chan received, 1)}
	go h.read()
	return h
}

func (h *held) read() {
	for {
		var f wire.Frame
		err := h.stream.RecvMsg(&f)
		h.mu.Lock()
		if h.answered {
			h.last <- received{f, err}
			h.mu.Unlock()
			return
		}
		if err == nil {
			err = h.hold(f)
		}
		if err != nil {
			h.end = err
			h.mu.Unlock()
			if !errors.Is(err, io.EOF) {
				h.refuse(err)
			}
			return
		}
		h.mu.Unlock()
	}
}

// minHeldFrame is what a held frame counts as, however small its payload:
// about what holding it costs (gRPC's smallest pooled buffer, and the
// frame's bookkeeping). Counted by its payload alone, a caller sending
// 1-byte frames would make the broker hold 16,384 of them, some 3 MiB, for
// what counts as 16 KiB.
const minHeldFrame = 512

// hold keeps f, a data frame within the room left; h.mu is held.
func (h *held) hold(f wire.Frame) error {
	n, err := f.DataLen()
	if err != nil {
		f.Free()
		return tunnel.CallerSentNotData()
	}
	cost := max(n, minHeldFrame)
	if cost > h.room {
		f.Free()
		return status.Error(codes.ResourceExhausted, fmt.Sprintf(
			"a caller may send at most %d bytes before established, early data included, each message counting as at least %d: wait for established",
			wire.MaxEarlyData, minHeldFrame))
	}
	release, err := h.ticket.HoldEarlyData(cost)
	if err != nil {
		f.Free()
		return err
	}
	h.room -= cost
	h.frames = append(h.frames, f)
	h.releases = append(h.releases, release)
	return nil
}

// answer stops the holding: the dial was answered. The held bytes no
// longer count as early data: they are the tunnel's, or, if the dial
// failed, freed. It returns the caller's leg for an established tunnel.
func (h *held) answer(established bool) *leg {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.answered = true
	for _, release := range h.releases {
		release()
	}
	h.releases = nil
	if !established {
		for i := range h.frames {
			h.frames[i].Free()
		}
		h.frames = nil
		return nil
	}
	l := &leg{ServerStreamLeg: tunnel.CallerStream(h.stream), frames: h.frames, end: h.end}
	if h.end == nil {
		l.last = h.last
	}
	return l
}

// leg is the caller's Dial stream as its tunnel's leg, with what the
// caller sent while the dial was pending received first.
type leg struct {
	*splice.ServerStreamLeg
	frames []wire.Frame
	end    error
	last   chan received
}

func (l *leg) Recv(f *wire.Frame) error {
	switch {
	case len(l.frames) > 0:
		*f, l.frames[0] = l.frames[0], wire.Frame{}
		l.frames = l.frames[1:]
		return nil
	case l.end != nil:
		return l.end
	case l.last != nil:
		r := <-l.last
		l.last = nil
		*f = r.f
		return r.err
	}
	return l.ServerStreamLeg.Recv(f)
}

// refused is the reason the caller's dial was refused while it was
// pending, if it was: anything but the caller's half-close.
func (l *leg) refused() error {
	if l.end == nil || errors.Is(l.end, io.EOF) {
		return nil
	}
	return l.end
}
