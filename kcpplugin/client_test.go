package kcpplugin

import (
	"io"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/resolver/manual"
)

// serveReplica serves handle over mTLS on a loopback port until the test
// ends, as one broker replica, and returns its address.
func serveReplica(t *testing.T, certs mtlsConfigs, handle dialHandler) string {
	t.Helper()
	return serveDialService(t, handle, grpc.Creds(credentials.NewTLS(certs.server)))
}

// replicas resolves to addrs, as DNS resolves a headless Service to every
// broker replica.
func replicas(addrs ...string) *manual.Resolver {
	r := manual.NewBuilderWithScheme("replicas")
	var state resolver.State
	for _, a := range addrs {
		state.Addresses = append(state.Addresses, resolver.Address{Addr: a})
	}
	r.InitialState(state)
	return r
}

func newTestClient(t *testing.T, target string, certs mtlsConfigs, opts ...grpc.DialOption) *Dialer {
	t.Helper()
	cc, err := NewClient(target, credentials.NewTLS(certs.client), opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	return NewDialer(cc)
}

func TestNewClientSpreadsDialsOverEveryReplica(t *testing.T) {
	certs := selfSignedMTLS(t)
	var dials [2]atomic.Int32
	var addrs []string
	for i := range dials {
		addrs = append(addrs, serveReplica(t, certs, establish(func(p *peer) error {
			dials[i].Add(1)
			return p.echo()
		})))
	}
	dialer := newTestClient(t, "replicas:///broker", certs, grpc.WithResolvers(replicas(addrs...)))

	// Round robin picks among the replicas it has connected to, so the
	// first dials may all reach the one that was ready first; pick_first,
	// gRPC's default, would send every dial to one replica.
	deadline := time.Now().Add(waitLong)
	for dials[0].Load() == 0 || dials[1].Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("dials per replica: %d and %d, want both used", dials[0].Load(), dials[1].Load())
		}
		c := dial(t, dialer)
		closeWrite(t, c)
		if _, err := io.ReadAll(c); err != nil {
			t.Fatal(err)
		}
		_ = c.Close()
	}
}
