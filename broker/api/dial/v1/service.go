// Package dial serves kcp.tunnel.v1.DialService: a caller names a Service in
// a logical cluster and gets a byte stream to it through an agent. The
// handler decodes the stream's messages; the broker's front door (package
// admission) admits, dials, carries and audits the tunnel.
package dial

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/broker/admission"
	"github.com/kcp-dev/tunnel-broker/broker/internal/receive"
	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	"github.com/kcp-dev/tunnel-broker/internal/tracing"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// Frontend names the Dial RPC in the front door's metrics, logs and audit
// lines.
const Frontend = "Dial"

// Config is what the dial service needs.
type Config struct {
	// Admission is the broker's front door, which it shares with the
	// CONNECT front end.
	Admission *admission.Admission
}

// Service implements DialService.
type Service struct {
	tunnelv1.UnimplementedDialServiceServer

	cfg Config
}

// New is a dial service with cfg.
func New(cfg Config) *Service { return &Service{cfg: cfg} }

// RegisterService registers s on srv.
func RegisterService(srv grpc.ServiceRegistrar, s *Service) {
	tunnelv1.RegisterDialServiceServer(srv, s)
}

// Dial implements DialService.Dial: the caller's target, its agent's tunnel,
// and the splice until the tunnel's end. The handler returns the caller's
// status itself once the tunnel has ended: nothing else ends the RPC.
func (s *Service) Dial(stream tunnelv1.DialService_DialServer) error {
	caller, _ := identity.PeerID(stream.Context())
	// A dial counts against its caller's tunnels from its stream's start,
	// so that dials that have not named their target yet count too.
	// The caller's trace context rides in the stream's metadata.
	ticket, err := s.cfg.Admission.Hold(tracing.FromMetadata(stream.Context()), admission.Caller{ID: caller, Frontend: Frontend})
	if err != nil {
		return err
	}
	defer ticket.Release()
	t, leg, err := establish(stream, ticket)
	if err != nil {
		return refused(stream, err)
	}
	return ticket.Splice(t, leg, "stream")
}

// refused returns a dial's failure, and tells a caller whose gRPC retry
// policy retries Unavailable (kcpplugin's) whether to send the dial to
// another replica. A dial this replica could not serve before ordering
// anything (no agent here, draining) may go elsewhere; any other is final,
// since its target may have seen it: the trailer grpc-retry-pushback-ms
// with a negative value stops the retry (gRPC's retry design, A6).
func refused(stream grpc.ServerStream, err error) error {
	if status.Code(err) == codes.Unavailable && !admission.ElsewhereMayServe(err) {
		stream.SetTrailer(noRetry)
	}
	return err
}

var noRetry = metadata.Pairs("grpc-retry-pushback-ms", "-1")

// establish receives the caller's target, has its agent connect to it,
// holding what the caller sends meanwhile (held), and tells the caller
// that the tunnel is established. It returns the tunnel and the caller's
// leg. It is a call of its own so that the handler's frame, which stays on
// the stack for the tunnel's life, stays small (docs/perf-history.md, idle
// tunnels' stacks).
func establish(stream tunnelv1.DialService_DialServer, ticket *admission.Ticket) (*tunnel.Tunnel, tunnel.Leg, error) {
	first, err := receive.First[tunnelv1.DialRequest](stream, "stream closed before naming a target")
	if err != nil {
		return nil, nil, err
	}
	ctx, refuse := context.WithCancelCause(stream.Context())
	defer refuse(nil)
	h := holdUntilAnswered(stream, ticket, len(first.GetEarlyData()), refuse)
	// The front door checks the target, nil included.
	t, err := ticket.Dial(ctx, first.GetTarget(), first.GetEarlyData())
	caller := h.answer(err == nil)
	if err == nil && caller.refused() != nil {
		// The caller overstepped just as its agent answered.
		err = caller.refused()
		t.End(err)
	}
	if err != nil {
		return nil, nil, err
	}
	established := &tunnelv1.DialResponse{Frame: &tunnelv1.DialResponse_Established{Established: &tunnelv1.Established{TunnelId: t.ID}}}
	if err := stream.Send(established); err != nil {
		t.End(status.Error(codes.Canceled, "caller went away"))
		return nil, nil, err
	}
	return t, caller, nil
}
