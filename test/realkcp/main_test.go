// Package realkcp runs kcp itself against the tunnel: `kcp start` (embedded
// etcd), built by test/tools/kcp/build.sh from the kcp release pinned there
// with docs/kcp/webhook-tunnel.patch applied, so that kcp's own webhook
// admission plugins (apis.kcp.io/ValidatingWebhook, MutatingWebhook) call
// the Services of webhook configurations through kcpplugin, a real broker and
// real syncer-agents, to TLS webhooks with CAs of their own.
//
// The provider's agent resolves its Service in a real kube-apiserver (the
// provider's service cluster, in plain mode, as beside kcp's api-syncagent);
// the workspaces' agents read services files (--services), which keeps the
// other cases to what kcp does.
//
// Everything runs in a network namespace of the tests' own
// (harness.RunIsolated). Run them alone with: go test -run RealKCP ./...
package realkcp

import (
	"fmt"
	"os"
	"sync"
	"testing"

	"go.uber.org/goleak"

	"github.com/kcp-dev/tunnel-broker/test/harness"
)

var (
	sharedOnce sync.Once
	shared     *server
	sharedMain harness.Main
)

// kcp is the package's kcp and broker, started by the first test that asks
// and shared by the rest: each test makes workspaces and agents of its own.
func kcp(t *testing.T) *server {
	t.Helper()
	sharedOnce.Do(func() { shared = startServer(&sharedMain) })
	if shared == nil {
		t.Fatal("kcp did not start: see the first test's output")
	}
	return shared
}

func TestMain(m *testing.M) {
	prepare := func() error {
		if _, err := harness.KCPBinary(); err != nil {
			return err
		}
		if _, err := harness.KubeBinaries(); err != nil {
			return err
		}
		// The broker and agent binaries, built outside the namespace too
		// (a build may need the Go module proxy).
		harness.Binaries(&sharedMain)
		return nil
	}
	os.Exit(harness.RunIsolated(m, prepare, func() int {
		code := m.Run()
		sharedMain.Close()
		if code == 0 {
			if err := goleak.Find(); err != nil {
				fmt.Fprintln(os.Stderr, "goleak:", err)
				code = 1
			}
		}
		return code
	}))
}
