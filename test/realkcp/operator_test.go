package realkcp

import (
	"strings"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"

	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// deploy/kcp's tests (go vet, and its tunnel package's: flags, SVID files
// that rotate), and kcp's own unit tests of what
// docs/kcp/webhook-tunnel.patch changes (the initializer, getHookSource's
// cluster for a local and a bound resource, the conversion factory per
// cluster), in kcp's source with the patch applied, as kcp's CI would run
// them.
func TestRealKCPSeamUnitTestsPassInKcp(t *testing.T) {
	out, err := harness.KCPSeamUnitTests()
	if err != nil {
		t.Fatalf("kcp's unit tests of the patched packages failed: %v\n%s", err, out)
	}
	for _, pkg := range []string{"tunnel-broker/deploy/kcp/tunnel", "kcp/pkg/admission/initializers", "kcp/pkg/admission/validatingwebhook",
		"kcp/pkg/admission/mutatingwebhook", "kcp/pkg/server"} {
		if !strings.Contains(out, "ok  \tgithub.com/kcp-dev/"+pkg) {
			t.Errorf("no passing tests of %s in:\n%s", pkg, out)
		}
	}
}

// The seam ported to the newest kcp release (docs/kcp/webhook-tunnel-v0.32.3.patch)
// applies to its source, and kcp's unit tests of the admission plugins and
// of the conversion factory pass there. kcp's servers themselves need a
// module the Go module proxy does not serve, so that release is not built
// or run here; this is the step to it, known.
func TestNewestKCPTakesTheSeam(t *testing.T) {
	out, err := harness.KCPNewestSeamUnitTests()
	if err != nil {
		t.Fatalf("the seam's port to the newest kcp does not apply or its tests failed: %v\n%s", err, out)
	}
	for _, pkg := range []string{"admission/initializers", "admission/validatingwebhook", "admission/mutatingwebhook", "server/conversioncheck"} {
		if !strings.Contains(out, "ok  \tgithub.com/kcp-dev/kcp/pkg/"+pkg) {
			t.Errorf("no passing tests of %s in:\n%s", pkg, out)
		}
	}
}

// kcp takes its SVID from files that rotate (--tunnel-svid-*): the one it
// started with expired before this test, the broker refuses an expired
// SVID, and a webhook call still goes through the tunnel, so kcp presents
// the SVID the files hold now.
func TestRealKCPFollowsItsSVIDRotation(t *testing.T) {
	s := kcp(t)
	if left := time.Until(s.firstSVIDExpiry); left > 0 {
		t.Fatalf("kcp's first SVID is still valid for %v", left)
	}
	if !strings.Contains(s.kcp.Log(), "kcp's SVID reloaded") {
		t.Fatal("kcp's log does not say that it reloaded its SVID")
	}
	w := s.workspace(t, "rotation")
	wh := s.startStandIn(t, "rotation")
	s.agent(t, "rotation", w.cluster, wh.Addr)
	w.validating(t, wh.CABundle, admissionregistrationv1.Fail)
	w.eventuallyRefused(t, true, "denied by webhook rotation")
	s.assertKCPTunnels(t, w.cluster, "rotation")
}
