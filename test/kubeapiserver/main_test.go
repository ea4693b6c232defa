// Package kubeapiserver proves the agent's Kubernetes resolver against a real
// kube-apiserver backed by a real etcd: Services, EndpointSlices and
// namespaces written through the API, dials through a real broker and agent
// to real listeners. Everything runs in a network namespace of the tests'
// own (harness.RunIsolated), where the webhook endpoints have addresses in
// harness.IsolatedNet. Run them alone with: go test -run KubeAPIServer ./...
package kubeapiserver

import (
	"fmt"
	"os"
	"sync"
	"testing"

	"go.uber.org/goleak"

	"github.com/kcp-dev/tunnel-broker/test/harness"
)

var (
	clusterOnce sync.Once
	cluster     *harness.KubeCluster
	clusterDir  string
	clusterErr  error
)

// kube is the package's etcd and kube-apiserver, started by the first test
// that asks and shared by the rest: each test uses namespaces, clusters and
// a sync target of its own.
func kube(t *testing.T) *harness.KubeCluster {
	t.Helper()
	clusterOnce.Do(func() {
		clusterDir, clusterErr = os.MkdirTemp("", "kubeapiserver-")
		if clusterErr == nil {
			cluster, clusterErr = harness.StartKubeCluster(clusterDir)
		}
	})
	if clusterErr != nil {
		t.Fatal(clusterErr)
	}
	return cluster
}

func TestMain(m *testing.M) {
	buildBinaries := func() error { _, err := harness.KubeBinaries(); return err }
	os.Exit(harness.RunIsolated(m, buildBinaries, func() int {
		code := m.Run()
		if cluster != nil {
			cluster.Stop()
		}
		if clusterDir != "" {
			os.RemoveAll(clusterDir)
		}
		if code == 0 {
			if err := goleak.Find(); err != nil {
				fmt.Fprintln(os.Stderr, "goleak:", err)
				code = 1
			}
		}
		return code
	}))
}
