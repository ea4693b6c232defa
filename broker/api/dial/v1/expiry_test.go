package dial

import (
	"errors"
	"io"
	"testing"
	"time"

	"github.com/kcp-dev/tunnel-broker/broker/internal/brokertest"
	"github.com/kcp-dev/tunnel-broker/internal/devca"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

func TestASpareDialConnectionClosesWhenItsSVIDExpires(t *testing.T) {
	b := startBroker(t, config{})
	addr := b.ExpiringPort(t, wire.DialProtocol, b.dial.ServeConn)
	// x509 times are whole seconds: this SVID expires in 2 to 3 seconds.
	src, err := b.CA.Source(devca.Leaf{SPIFFEID: kcpPath, NotAfter: time.Now().Add(3 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	conn, read := brokertest.ConnAs(t, addr, src, wire.DialProtocol)
	brokertest.Accepted(t, conn, brokerID)
	testutil.Eventually(t, "the spare to count", func() bool { return b.dial.spares.Held(brokertest.ID(kcpPath)) == 1 })

	// At the expiry, with no grace, the broker closes the spare's socket
	// under its TLS: no answer (unlike the drain's Unavailable), and no
	// close_notify.
	got, err := io.ReadAll(read)
	if len(got) != 0 || !errors.Is(err, wire.ErrNoCloseNotify) {
		t.Fatalf("after its SVID expired the spare read %x, %v; want its socket closed without a close_notify", got, err)
	}
	// And it no longer counts against the caller's spares.
	testutil.Eventually(t, "the expired spare to stop counting", func() bool { return b.dial.spares.TotalHeld() == 0 })
}
