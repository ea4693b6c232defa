package harness

import (
	"context"
	"log/slog"
	"net"
	"os"
	"sync"
	"time"

	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/broker/server"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
)

// Broker is a broker replica running in the test process.
type Broker struct {
	Addr   string
	Server *server.Server
	stop   func()
}

// Stop shuts the broker down as on SIGTERM (drain, grace, stop) and waits.
func (b *Broker) Stop() { b.stop() }

// Kill ends the broker's connections at once, as a crash would.
func (b *Broker) Kill() {
	b.Server.Stop()
	b.stop()
}

// BrokerOptions tune an in-process broker.
type BrokerOptions struct {
	ID          string
	DialTimeout time.Duration
	// Policy defaults to DefaultPolicy.
	Policy *policy.File
	// Identity defaults to the SVID of /broker.
	Identity identity.SVIDSource
	// Grace on Stop; defaults to 2s in tests.
	Grace time.Duration
	// Listen defaults to 127.0.0.1:0.
	Listen string
	// Config adjusts the rest of the broker's configuration.
	Config func(*server.Config)
}

// StartBroker runs a broker replica on a loopback port until the test ends.
func (e *Env) StartBroker(opts BrokerOptions) *Broker {
	e.T.Helper()
	if opts.ID == "" {
		opts.ID = "broker-0"
	}
	var src identity.SVIDSource = opts.Identity
	if src == nil {
		src = e.Identity("/broker")
	}
	if opts.Listen == "" {
		opts.Listen = "127.0.0.1:0"
	}
	if opts.Grace == 0 {
		opts.Grace = 2 * time.Second
	}
	l, err := net.Listen("tcp", opts.Listen)
	if err != nil {
		e.T.Fatal(err)
	}
	cfg := server.Config{
		ID:          opts.ID,
		Identity:    src,
		Policy:      e.policyFor(opts.Policy),
		DialTimeout: opts.DialTimeout,
		Grace:       opts.Grace,
		Log:         Logger(),
	}
	if opts.Config != nil {
		opts.Config(&cfg)
	}
	srv := server.New(cfg)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(ctx, l)
	}()
	b := &Broker{Addr: l.Addr().String(), Server: srv}
	var once sync.Once
	b.stop = func() { once.Do(func() { cancel(); <-done }) }
	e.T.Cleanup(b.stop)
	return b
}

// Agent is a syncer agent running in the test process.
type Agent struct {
	stop func()
}

// Stop stops the agent and waits until its tunnels are gone.
func (a *Agent) Stop() { a.stop() }

// StartAgent runs an agent with identity path that serves the static
// services, and waits until the broker at brokerAddr has registered it.
func (e *Env) StartAgent(brokerAddr, path string, services lookup.StaticFile) *Agent {
	e.T.Helper()
	resolver, err := lookup.NewStatic(services)
	if err != nil {
		e.T.Fatal(err)
	}
	return e.StartAgentWithResolver(brokerAddr, path, resolver)
}

// Logger logs at warning level unless TUNNEL_TEST_LOG=debug asks for all.
func Logger() *slog.Logger {
	level := slog.LevelWarn
	if os.Getenv("TUNNEL_TEST_LOG") == "debug" {
		level = slog.LevelDebug
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
}
