package dial

import (
	"errors"
	"io"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// failure is the end of a splice that was not clean, with the side at fault.
type failure struct {
	byCaller bool
	err      error
}

// splice carries bytes both ways between the caller's Dial stream and the
// agent's Tunnel stream until both directions are half-closed, or either side
// fails. It returns the status that ends each RPC (nil for OK).
//
// Each direction runs in its own goroutine because a gRPC Recv cannot be
// interrupted: only the end of its RPC frees it. So when one side fails, both
// handlers return and the blocked Recv of the other direction ends with them.
func splice(caller tunnelv1.DialService_DialServer, agent tunnelv1.AgentService_TunnelServer) (callerStatus, agentStatus error) {
	results := make(chan *failure, 2)
	go func() { results <- copyUp(caller, agent) }()
	go func() { results <- copyDown(agent, caller) }()
	for pending := 2; pending > 0; {
		var f *failure
		// A copy blocked in Send on one stream does not see the other
		// stream end, so watch both ends here as well.
		select {
		case f = <-results:
			pending--
		case <-caller.Context().Done():
			f = &failure{byCaller: true, err: caller.Context().Err()}
		case <-agent.Context().Done():
			f = &failure{err: agent.Context().Err()}
		}
		if f == nil {
			continue
		}
		if f.byCaller {
			if status.Code(f.err) == codes.InvalidArgument {
				return f.err, status.Errorf(codes.Canceled, "caller broke the protocol: %v", f.err)
			}
			return status.Error(codes.Canceled, "caller went away"),
				status.Errorf(codes.Canceled, "caller went away: %v", f.err)
		}
		return status.Errorf(codes.Unavailable, "tunnel lost on the agent's side: %v", f.err),
			status.Errorf(codes.Aborted, "tunnel aborted: %v", f.err)
	}
	return nil, nil
}

// copyUp forwards the caller's bytes to the agent, then its half-close.
func copyUp(caller tunnelv1.DialService_DialServer, agent tunnelv1.AgentService_TunnelServer) *failure {
	for {
		msg, err := caller.Recv()
		if errors.Is(err, io.EOF) {
			if err := agent.Send(&tunnelv1.TunnelResponse{Frame: &tunnelv1.TunnelResponse_CloseWrite{CloseWrite: &tunnelv1.CloseWrite{}}}); err != nil {
				return &failure{err: err}
			}
			return nil
		}
		if err != nil {
			return &failure{byCaller: true, err: err}
		}
		data := msg.GetData()
		if len(data) == 0 {
			return &failure{byCaller: true, err: status.Error(codes.InvalidArgument, "protocol error: after the target, a caller may only send non-empty data")}
		}
		if err := agent.Send(&tunnelv1.TunnelResponse{Frame: &tunnelv1.TunnelResponse_Data{Data: data}}); err != nil {
			return &failure{err: err}
		}
	}
}

// copyDown forwards the agent's bytes to the caller, then its half-close.
func copyDown(agent tunnelv1.AgentService_TunnelServer, caller tunnelv1.DialService_DialServer) *failure {
	for {
		msg, err := agent.Recv()
		if errors.Is(err, io.EOF) {
			if err := caller.Send(&tunnelv1.DialResponse{Frame: &tunnelv1.DialResponse_CloseWrite{CloseWrite: &tunnelv1.CloseWrite{}}}); err != nil {
				return &failure{byCaller: true, err: err}
			}
			return nil
		}
		if err != nil {
			return &failure{err: err}
		}
		data := msg.GetData()
		if len(data) == 0 {
			return &failure{err: errors.New("protocol error: after opening, an agent may only send data")}
		}
		if err := caller.Send(&tunnelv1.DialResponse{Frame: &tunnelv1.DialResponse_Data{Data: data}}); err != nil {
			return &failure{byCaller: true, err: err}
		}
	}
}
