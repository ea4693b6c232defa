package realkcp

import (
	"strings"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"

	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// deploy/kcp's own tests: go vet, and its tunnel package's (flags, SVID
// files that rotate). kcp's unit tests of the seam run in make test's
// kcp-seam step when a patch changes (deploy/kcp/build.sh seam).
func TestRealKCPDeployKcpModulePasses(t *testing.T) {
	out, err := harness.DeployKcpTests()
	if err != nil {
		t.Fatalf("deploy/kcp's tests failed: %v\n%s", err, out)
	}
	if !strings.Contains(out, "ok  \tgithub.com/kcp-dev/tunnel-broker/deploy/kcp/tunnel") {
		t.Errorf("no passing tests of deploy/kcp/tunnel in:\n%s", out)
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
