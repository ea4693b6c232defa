package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"syscall"
	"time"

	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/internal/errinfo"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
)

// What a person can do about an error, in words: the one place tunnelctl
// makes them. A hint is chosen by what the error is, never by what its
// message says: the reason the broker attached to its status (package
// errinfo), else the error of tunnelctl's own connection to the broker as
// its dialer and credentials saw it (connFailure), else the status's code.

// presented is the SVID tunnelctl presents to the broker, once loaded: the
// hints check it before blaming the broker.
var presented x509svid.Source

// explain adds what a person can do about a broker's status.
func explain(err error) string {
	st, ok := status.FromError(err)
	if !ok {
		return err.Error()
	}
	hint := ownHint(err, st)
	if hint == "" {
		hint = reasonHint(errinfo.Of(err), st)
	}
	if hint == "" && st.Code() == codes.Unavailable {
		hint = connectionHint(lastConn.get())
	}
	if hint == "" {
		hint = map[codes.Code]string{
			codes.InvalidArgument:   "check the cluster name (not a path), namespace, service and port",
			codes.Unavailable:       "no agent could carry the tunnel now: is the syncer agent of that cluster running and registered (tunnelctl agents)?",
			codes.NotFound:          "the agent knows no such Service or port in that namespace",
			codes.DeadlineExceeded:  "the agent did not connect in time: is the Service's endpoint up?",
			codes.PermissionDenied:  "your SPIFFE ID is not allowed this by the broker's policy",
			codes.ResourceExhausted: "a limit was hit; try again later",
			codes.Unauthenticated:   "the broker did not see a SPIFFE identity",
		}[st.Code()]
	}
	if hint == "" {
		return fmt.Sprintf("%s: %s", st.Code(), st.Message())
	}
	return fmt.Sprintf("%s: %s\n  (%s)", st.Code(), st.Message(), hint)
}

// ownHint says what is wrong with tunnelctl's own SVID, if that is why the
// broker could not be reached or refused it: checked first, before the
// hints that blame the broker or the network.
func ownHint(err error, st *status.Status) string {
	if st.Code() != codes.Unavailable && st.Code() != codes.Unauthenticated {
		return ""
	}
	p, ok := identity.DiagnoseOwn(presented, err, time.Now())
	switch {
	case !ok:
		return ""
	case p.Expired:
		return fmt.Sprintf("your SVID (--svid-cert) expired at %s: get a new one (from your SPIRE agent, or tunnelctl dev-ca for a dev trust domain)",
			p.NotAfter.UTC().Format(time.RFC3339))
	case p.PeerAlert == "expired certificate":
		return fmt.Sprintf("the broker refused your certificate as expired, but your SVID is valid until %s: is the broker's clock or yours wrong?",
			p.NotAfter.UTC().Format(time.RFC3339))
	}
	return fmt.Sprintf("the broker refused your certificate (%s, TLS alert: %s): is your trust domain's CA in the broker's bundle (or its --federated-bundle)? The broker's log says why",
		p.ID, p.PeerAlert)
}

// reasonHint is the hint for a status the broker answered with reason
// (errinfo; docs/protocol.md §5), or "" for the code's.
func reasonHint(reason string, st *status.Status) string {
	switch reason {
	case errinfo.NoAgent:
		return "no agent serves that cluster on this broker replica: is its syncer agent running and registered (tunnelctl agents)?"
	case errinfo.ReplicaDraining:
		return "this broker replica is shutting down: try again, or another replica"
	case errinfo.AgentGone:
		return "the agent went away during the dial: is it restarting? (tunnelctl agents)"
	case errinfo.AgentTimeout:
		return "the agent did not connect in time: is the Service's endpoint up?"
	case errinfo.TunnelLost:
		return "the agent's end of the tunnel ended: its log says why, under the tunnel's id"
	case errinfo.BrokerStopping:
		return "the broker replica stopped: try again"
	case errinfo.IdleTimeout:
		return "the tunnel carried nothing for the broker's --idle-timeout"
	case errinfo.NoEndpoints:
		return "the agent found the Service, but it has no endpoints: are its pods ready?"
	case errinfo.TargetRefused:
		return "the agent reached the Service, but its port refused the connection: is the Service's pod listening on that port?"
	case errinfo.TargetUnreachable:
		return "the agent could not connect to the Service's endpoints: are its pods up and reachable from the agent?"
	case errinfo.AgentDialFailed:
		switch st.Code() {
		case codes.Unavailable:
			return "the agent could not connect the dial: its log says why, under the tunnel's id"
		case codes.PermissionDenied:
			return "the agent refused that target: its log says why, under the tunnel's id"
		case codes.DeadlineExceeded:
			return "the agent could not connect in time: is the Service's endpoint up and reachable from the agent?"
		}
	}
	return ""
}

// connFailure is the last failure of tunnelctl's connection to the broker,
// as its own dialer (dialBroker) and credentials (recordingCreds) saw it,
// with its type: gRPC passes it on to a call only as text. A handshake
// that succeeds clears it.
type connFailure struct {
	mu        sync.Mutex
	err       error
	handshake bool // err is the TLS handshake's, not the dial's
}

var lastConn connFailure

func (f *connFailure) set(err error, handshake bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.err, f.handshake = err, handshake
}

func (f *connFailure) get() *connFailure {
	f.mu.Lock()
	defer f.mu.Unlock()
	return &connFailure{err: f.err, handshake: f.handshake}
}

// dialBroker is tunnelctl's dialer: it connects to the broker's address
// (the host:port of --broker, resolved here: the target is passthrough)
// and records why it could not.
func dialBroker(ctx context.Context, addr string) (net.Conn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		lastConn.set(err, false)
	}
	return c, err
}

// recordingCreds are tunnelctl's credentials, recording why a handshake
// failed.
type recordingCreds struct {
	credentials.TransportCredentials
}

func (c recordingCreds) ClientHandshake(ctx context.Context, authority string, raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, info, err := c.TransportCredentials.ClientHandshake(ctx, authority, raw)
	if ctx.Err() != context.Canceled { // not a handshake gRPC gave up on
		lastConn.set(err, err != nil)
	}
	return conn, info, err
}

func (c recordingCreds) Clone() credentials.TransportCredentials {
	return recordingCreds{c.TransportCredentials.Clone()}
}

// connectionHint tells apart, by the error's type, why tunnelctl could not
// reach the broker: its name does not resolve, nothing listens at its
// address, it cannot be reached otherwise, the port does not serve gRPC,
// or the TLS handshake failed. "" if tunnelctl's connection did not fail.
func connectionHint(f *connFailure) string {
	switch {
	case f.err == nil:
		return ""
	case errors.Is(f.err, identity.ErrNotGRPC):
		return "--broker names a port of the broker that does not serve gRPC: use its --listen port (8443 by default)"
	case f.handshake:
		return "the TLS handshake with the broker failed: check --broker-spiffe-id, that your --trust-bundle holds the broker's CA, and the broker's log for why it refused you"
	}
	if _, ok := errors.AsType[*net.DNSError](f.err); ok {
		return "the broker's name in --broker does not resolve: check the host name, and your DNS"
	}
	if errors.Is(f.err, syscall.ECONNREFUSED) {
		return "nothing listens at --broker: is the broker running, and is that its port (its --listen)?"
	}
	return "the broker is not reachable at --broker: is it running and listening there?"
}
