package tunnel

import (
	"context"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/internal/errinfo"
)

// DefaultIdleTimeout ends a tunnel that carries nothing for 10 minutes: far
// longer than any webhook call, and short enough that tunnels whose peers
// forgot them do not pile up.
const DefaultIdleTimeout = 10 * time.Minute

// The idle limit ends a tunnel that carried no frame, either way, for
// idleLimit. Rather than reset a timer for every frame, each frame only notes
// its time, and the timer, when it fires, either ends the tunnel or waits for
// the rest of the limit since the last frame.

// touch notes that a frame passed.
func (t *Tunnel) touch() { t.lastFrame.Store(t.clock.Now().UnixNano()) }

// quiet is how long the tunnel has carried nothing.
func (t *Tunnel) quiet() time.Duration {
	return time.Duration(t.clock.Now().UnixNano() - t.lastFrame.Load())
}

// startIdleTimer starts the idle limit, which ends the tunnel with stop.
func (t *Tunnel) startIdleTimer(stop context.CancelCauseFunc) {
	if t.idleLimit <= 0 {
		return
	}
	t.idleMu.Lock()
	defer t.idleMu.Unlock()
	t.idleTimer = t.clock.AfterFunc(t.idleLimit, func() { t.checkIdle(stop) })
}

func (t *Tunnel) stopIdleTimer() {
	t.idleMu.Lock()
	defer t.idleMu.Unlock()
	if t.idleTimer != nil {
		t.idleTimer.Stop()
		t.idleTimer = nil // so that a checkIdle running now does not reset it
	}
}

// checkIdle ends the tunnel with stop if it has carried nothing for its
// idle limit, and otherwise looks again when it could have.
func (t *Tunnel) checkIdle(stop context.CancelCauseFunc) {
	quiet := t.quiet()
	if quiet < t.idleLimit {
		t.idleMu.Lock()
		if t.idleTimer != nil {
			t.idleTimer.Reset(t.idleLimit - quiet)
		}
		t.idleMu.Unlock()
		return
	}
	metrics.LimitsHit.WithLabelValues("idle_timeout").Inc()
	msg := errinfo.Errorf(codes.DeadlineExceeded, errinfo.IdleTimeout, "tunnel carried nothing for %v", t.idleLimit)
	stop(&brokerEnd{msg, msg})
}
