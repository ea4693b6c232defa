package lookup

import (
	"context"
	"fmt"
	"net"
	"os"
	"slices"
	"strconv"

	"github.com/kcp-dev/tunnel-broker/internal/yamlfile"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// StaticFile is the format of a static mapping file:
//
//	services:
//	- cluster: root
//	  namespace: default
//	  name: webhook
//	  ports:
//	    443: 127.0.0.1:9443
type StaticFile struct {
	Services []StaticService `json:"services"`
}

// StaticService maps the ports of one Service to fixed addresses.
type StaticService struct {
	Cluster   string            `json:"cluster"`
	Namespace string            `json:"namespace"`
	Name      string            `json:"name"`
	Ports     map[string]string `json:"ports"`
}

// Static resolves from a fixed table: for development, demos and clusters
// without a Kubernetes API the agent can read.
type Static struct {
	table    map[string]string // Target.Key() -> host:port
	clusters []string
}

// LoadStatic reads a mapping file.
func LoadStatic(path string) (*Static, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var f StaticFile
	if err := yamlfile.Unmarshal(raw, &f); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	s, err := NewStatic(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return s, nil
}

// NewStatic checks every entry the way a dial is checked.
func NewStatic(f StaticFile) (*Static, error) {
	s := &Static{table: map[string]string{}}
	for i, svc := range f.Services {
		for portText, addr := range svc.Ports {
			port, err := parsePort(portText)
			if err != nil {
				return nil, fmt.Errorf("services[%d].ports: %w", i, err)
			}
			t := &tunnelv1.Target{Cluster: svc.Cluster, Namespace: svc.Namespace, Service: svc.Name, Port: uint32(port)}
			if err := t.Validate(); err != nil {
				return nil, fmt.Errorf("services[%d]: %w", i, err)
			}
			if err := checkAddress(addr); err != nil {
				return nil, fmt.Errorf("services[%d].ports.%d: %w", i, port, err)
			}
			s.table[t.Key()] = addr
			if !slices.Contains(s.clusters, svc.Cluster) {
				s.clusters = append(s.clusters, svc.Cluster)
			}
		}
	}
	if len(s.clusters) == 0 {
		return nil, fmt.Errorf("no services")
	}
	return s, nil
}

// parsePort reads a Service port: a number from 1 to 65535.
func parsePort(text string) (uint64, error) {
	port, err := strconv.ParseUint(text, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("port %q is not a number", text)
	}
	if port < 1 || port > 65535 {
		return 0, fmt.Errorf("port %d is outside 1-65535", port)
	}
	return port, nil
}

// checkAddress refuses what the agent could never connect to.
func checkAddress(addr string) error {
	_, portText, err := net.SplitHostPort(addr)
	if err != nil {
		return err
	}
	if _, err := parsePort(portText); err != nil {
		return fmt.Errorf("address %s: %w", addr, err)
	}
	return nil
}

// Clusters implements Resolver.
func (s *Static) Clusters() []string { return s.clusters }

// Resolve implements Resolver.
func (s *Static) Resolve(_ context.Context, t *tunnelv1.Target) ([]string, error) {
	if t.GetIp() != "" {
		return nil, status.Errorf(codes.PermissionDenied, "refused: a static table maps Services to addresses, not addresses to Services, so it cannot tell whose address %s is", t.GetIp())
	}
	addr, ok := s.table[t.Key()]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "no service %s/%s with port %d in logical cluster %s",
			t.GetNamespace(), t.GetService(), t.GetPort(), t.GetCluster())
	}
	return []string{addr}, nil
}
