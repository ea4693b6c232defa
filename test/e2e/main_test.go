// Package e2e runs the broker, agents and kcp's real webhook client together,
// over real gRPC and real mTLS, on loopback.
package e2e

import (
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// client-go keeps a process-wide transport cache: a transport with a
		// client certificate file gets a rotation goroutine that lives as
		// long as the process, by design.
		goleak.IgnoreAnyFunction("k8s.io/client-go/transport.(*dynamicClientCert).run"),
		goleak.IgnoreAnyFunction("k8s.io/client-go/transport.(*dynamicClientCert).processNextWorkItem"),
		goleak.IgnoreAnyFunction("k8s.io/apimachinery/pkg/util/wait.PollImmediateUntil"),
		goleak.IgnoreTopFunction("k8s.io/apimachinery/pkg/util/wait.PollImmediateUntilWithContext.poller.func1.1"),
		goleak.IgnoreTopFunction("k8s.io/client-go/util/workqueue.(*delayingType[...]).waitingLoop"),
	)
}
