package identity

import (
	"crypto/x509"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/kcp-dev/tunnel-broker/internal/devca"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
)

func TestRefusalLogsAreSampledAndSayHowManyWereLeftOut(t *testing.T) {
	var log logBuffer
	var n counts
	clock := &fakeClock{now: time.Now()}
	r := &Refusals{Log: log.logger(), Count: n.count, PerSecond: 5, now: clock.Now}
	junk := refused(ReasonProtocol, errors.New("tls: first record does not look like a TLS handshake"))
	for range 999 {
		r.report("10.0.0.1:1234", junk)
	}
	r.report("10.0.0.1:1234", refused(ReasonTimeout, errors.New("i/o timeout")))
	if got := n.get(ReasonProtocol) + n.get(ReasonTimeout); got != 1000 {
		t.Fatalf("counted %d refusals, want every one of 1000", got)
	}
	// Five lines, then one that says how many more there were, by reason.
	testutil.Eventually(t, "the line about the refusals left out", func() bool { return len(log.lines()) == 6 })
	lines := log.lines()
	for _, l := range lines[:5] {
		if !strings.Contains(l, `msg="TLS handshake refused"`) || !strings.Contains(l, "reason=protocol") || !strings.Contains(l, "remote=10.0.0.1:1234") {
			t.Errorf("line %q", l)
		}
	}
	if want := "suppressed=995 by_reason.timeout=1 by_reason.protocol=994"; !strings.Contains(lines[5], want) {
		t.Errorf("summary %q, want it to say %q", lines[5], want)
	}

	// The next second logs again.
	clock.advance(time.Second)
	r.report("10.0.0.2:1", junk)
	if lines := log.lines(); len(lines) != 7 || !strings.Contains(lines[6], "remote=10.0.0.2:1") {
		t.Errorf("a new second did not log again: %q", lines[len(lines)-1])
	}
}

func TestAPanicDuringAHandshakeFailsOnlyThatHandshake(t *testing.T) {
	ca := newCA(t, "ca")
	var log logBuffer
	var n counts
	// An authorizer stands for any code a peer's certificate reaches
	// during the handshake.
	authorize := func(id spiffeid.ID, _ [][]*x509.Certificate) error {
		if id.Path() == "/boom" {
			panic("a bug in a dependency")
		}
		return nil
	}
	addr, results := serve(t, ServerCredentials(newSource(t, ca, devca.Leaf{SPIFFEID: "/broker"}), authorize,
		ReportRefusals(&Refusals{Log: log.logger(), Count: n.count})))
	if _, err := dialAndRead(addr, attackerConfig(rawCert(t, ca, devca.Leaf{SPIFFEID: "/boom"}))); err == nil {
		t.Fatal("admitted")
	}
	if r := next(t, results); ReasonOf(r.err) != ReasonInternal {
		t.Fatalf("refused for %q (%v), want %q", ReasonOf(r.err), r.err, ReasonInternal)
	}
	if _, err := dialAndRead(addr, attackerConfig(rawCert(t, ca, devca.Leaf{SPIFFEID: "/kcp"}))); err != nil {
		t.Fatalf("the next handshake: %v", err)
	}
	if r := next(t, results); r.err != nil {
		t.Fatal(r.err)
	}
	if !strings.Contains(strings.Join(log.lines(), "\n"), "a bug in a dependency") || n.get(ReasonInternal) != 1 {
		t.Errorf("the panic was not logged and counted:\n%s", strings.Join(log.lines(), "\n"))
	}
}
