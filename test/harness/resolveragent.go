package harness

import (
	"context"
	"path/filepath"
	"regexp"
	"sync"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"

	"github.com/kcp-dev/tunnel-broker/internal/identity"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/agent"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
)

// StartAgentWithResolver runs an in-process agent with identity path that
// resolves with r (e.g. a lookup.Kube whose caches have synced), and waits
// until the broker at brokerAddr has registered it.
func (e *Env) StartAgentWithResolver(brokerAddr, path string, r lookup.Resolver) *Agent {
	e.T.Helper()
	// Named like the agent binaries of StartAgentProcess: the last element
	// of the path, a DNS-1123 label as agent names must be.
	return e.StartAgentAs(brokerAddr, filepath.Base(path), e.Identity(path), r)
}

// StartAgentAs runs an in-process agent named name with the identity src
// (e.g. one of another trust domain, see Env.Source), and waits until the
// broker at brokerAddr has registered it.
func (e *Env) StartAgentAs(brokerAddr, name string, src identity.SVIDSource, r lookup.Resolver) *Agent {
	e.T.Helper()
	registered := make(chan struct{}, 1)
	authorize := tlsconfig.AuthorizeID(ID("/broker"))
	a := &agent.Agent{
		Broker:      brokerAddr,
		Credentials: identity.ClientCredentials(src, authorize),
		Name:        name,
		Resolver:    r,
		Log:         Logger(),
		Registered: func(string) {
			select {
			case registered <- struct{}{}:
			default:
			}
		},
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = a.Run(ctx)
	}()
	select {
	case <-registered:
	case <-time.After(10 * time.Second):
		cancel()
		<-done
		e.T.Fatal("agent did not register within 10s")
	}
	var once sync.Once
	stop := func() { once.Do(func() { cancel(); <-done }) }
	e.T.Cleanup(stop)
	return &Agent{stop: stop}
}

var registeredRE = regexp.MustCompile(`registered with broker`)

// StartKubeAgentProcess runs the syncer-agent binary with identity path,
// resolving through the Kubernetes API with kubeconfig and the resolver
// flags in args (e.g. --sync-target-name), and waits until it registered.
func (e *Env) StartKubeAgentProcess(brokerAddr, path, kubeconfig string, args ...string) *Process {
	e.T.Helper()
	f := e.SVID(path)
	lines := make(chan string, 100)
	args = append([]string{"--broker", brokerAddr, "--name", filepath.Base(path), "--kubeconfig", kubeconfig,
		"--svid-cert", f.Cert, "--svid-key", f.Key, "--trust-bundle", f.Bundle}, args...)
	p := start(e.T, "syncer-agent", args, lines)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for {
		select {
		case line := <-lines:
			if registeredRE.MatchString(line) {
				return p
			}
		case <-p.done:
			e.T.Fatalf("agent exited: %v", p.err)
		case <-ctx.Done():
			e.T.Fatal("agent did not register within 30s")
		}
	}
}
