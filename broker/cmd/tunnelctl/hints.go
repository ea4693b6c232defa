package main

import (
	"fmt"
	"strings"
	"time"

	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/internal/identity"
)

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
		hint = map[codes.Code]string{
			codes.InvalidArgument:   "check the cluster name (not a path), namespace, service and port",
			codes.Unavailable:       unavailableHint(st.Message()),
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

// unavailableHint tells apart the reasons for Unavailable by what the
// message says: the broker's name does not resolve, nothing listens at its
// address, it cannot be reached otherwise, the TLS handshake with it
// failed on tunnelctl's side; or the broker answered: no agent serves the
// cluster, the agent reached the Service but its port refused, ...
func unavailableHint(msg string) string {
	switch {
	case strings.Contains(msg, identity.ErrNotGRPC.Error()):
		return "--broker names a port of the broker that does not serve gRPC: use its --listen port (8443 by default)"
	case strings.Contains(msg, "authentication handshake failed"):
		return "the TLS handshake with the broker failed: check --broker-spiffe-id, that your --trust-bundle holds the broker's CA, and the broker's log for why it refused you"
	case strings.Contains(msg, "name resolver error"), strings.Contains(msg, "produced zero addresses"),
		strings.Contains(msg, "no such host"), strings.Contains(msg, "server misbehaving"):
		return "the broker's name in --broker does not resolve: check the host name, and your DNS"
	case strings.Contains(msg, "connection error"), strings.Contains(msg, "while dialing"):
		if strings.Contains(msg, "connection refused") {
			return "nothing listens at --broker: is the broker running, and is that its port (its --listen)?"
		}
		return "the broker is not reachable at --broker: is it running and listening there?"
	case strings.Contains(msg, "no agent serves logical cluster"):
		return "no agent serves that cluster on this broker replica: is its syncer agent running and registered (tunnelctl agents)?"
	case strings.Contains(msg, ": connecting to ") && strings.Contains(msg, "connection refused"):
		return "the agent reached the Service, but its port refused the connection: is the Service's pod listening on that port?"
	case strings.Contains(msg, "has no endpoints"):
		return "the agent found the Service, but it has no endpoints: are its pods ready?"
	case strings.Contains(msg, ": connecting to "):
		return "the agent could not connect to the Service's endpoints: are its pods up and reachable from the agent?"
	case strings.Contains(msg, "went away"):
		return "the agent went away during the dial: is it restarting? (tunnelctl agents)"
	case strings.Contains(msg, "tunnel lost on the agent's side"):
		return "the agent's end of the tunnel ended: its log says why, under the tunnel's id"
	}
	return "no agent could carry the tunnel now: is the syncer agent of that cluster running and registered (tunnelctl agents)?"
}
