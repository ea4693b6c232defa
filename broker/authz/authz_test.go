package authz

import (
	"log/slog"
	"testing"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	reflectionv1 "google.golang.org/grpc/reflection/grpc_reflection_v1"
	reflectionv1alpha "google.golang.org/grpc/reflection/grpc_reflection_v1alpha"

	"github.com/kcp-dev/tunnel-broker/broker/policy"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

func id(path string) spiffeid.ID {
	return spiffeid.RequireFromPath(spiffeid.RequireTrustDomainFromString("example.org"), path)
}

func TestEachServiceIsAllowedToItsRoleAlone(t *testing.T) {
	p, err := policy.New(policy.File{
		Agents:    []policy.AgentRule{{ID: id("/agent").String(), Clusters: []string{"*"}}},
		Callers:   []policy.CallerRule{{ID: id("/kcp").String()}},
		Operators: []policy.OperatorRule{{ID: id("/oncall").String()}},
	})
	if err != nil {
		t.Fatal(err)
	}
	a := &Authorizer{Policy: p, Log: slog.New(slog.DiscardHandler)}
	health := "/" + healthpb.Health_ServiceDesc.ServiceName + "/Check"
	reflection := "/" + reflectionv1.ServerReflection_ServiceDesc.ServiceName + "/ServerReflectionInfo"
	reflectionAlpha := "/" + reflectionv1alpha.ServerReflection_ServiceDesc.ServiceName + "/ServerReflectionInfo"
	for _, tc := range []struct {
		method string
		who    map[string]bool // by SPIFFE ID path: allowed
	}{
		{tunnelv1.DialService_Dial_FullMethodName, map[string]bool{"/kcp": true, "/agent": false, "/oncall": false, "/stranger": false}},
		{tunnelv1.AgentService_Connect_FullMethodName, map[string]bool{"/kcp": false, "/agent": true, "/oncall": false, "/stranger": false}},
		{tunnelv1.AgentService_Tunnel_FullMethodName, map[string]bool{"/kcp": false, "/agent": true, "/oncall": false, "/stranger": false}},
		{tunnelv1.AdminService_ListAgents_FullMethodName, map[string]bool{"/kcp": false, "/agent": false, "/oncall": true, "/stranger": false}},
		{health, map[string]bool{"/kcp": true, "/agent": true, "/oncall": true, "/stranger": false}},
		{reflection, map[string]bool{"/kcp": true, "/agent": true, "/oncall": true, "/stranger": false}},
		{reflectionAlpha, map[string]bool{"/kcp": true, "/agent": true, "/oncall": true, "/stranger": false}},
		// A service the broker does not know, and names that are not
		// methods, are refused to everyone.
		{"/kcp.tunnel.v1.DialServiceX/Dial", map[string]bool{"/kcp": false}},
		{"/kcp.tunnel.v1.Other/Dial", map[string]bool{"/kcp": false, "/oncall": false}},
		{"kcp.tunnel.v1.DialService", map[string]bool{"/kcp": false}},
		{"", map[string]bool{"/kcp": false}},
	} {
		for path, want := range tc.who {
			if got := a.allowed(id(path), tc.method); got != want {
				t.Errorf("%s calling %q: allowed %v, want %v", path, tc.method, got, want)
			}
		}
	}
}
