package lookup

import (
	"fmt"
	"slices"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// Scope is a set of logical clusters and of namespaces of logical clusters,
// as dials name them (in syncer mode, the upstream namespace, not the
// physical cluster's). It is written as a comma-separated list of entries,
// each one of:
//
//	CLUSTER            every namespace of that logical cluster
//	CLUSTER/NAMESPACE  that namespace only
//	*                  every namespace of every logical cluster
//
// The zero Scope holds nothing.
type Scope struct {
	entries    []string
	all        bool
	clusters   map[string]bool
	namespaces map[string]bool // "cluster/namespace"
}

// ParseScope reads a Scope and names the first entry it cannot take.
func ParseScope(list string) (Scope, error) {
	s := Scope{clusters: map[string]bool{}, namespaces: map[string]bool{}}
	for _, entry := range strings.Split(list, ",") {
		entry = strings.TrimSpace(entry)
		if entry == "" {
			continue
		}
		cluster, namespace, hasNamespace := strings.Cut(entry, "/")
		switch {
		case entry == "*":
			s.all = true
		case cluster == "*":
			return Scope{}, fmt.Errorf("%q: \"*\" stands alone, for every logical cluster; name a cluster to name one of its namespaces", entry)
		case tunnelv1.ValidateClusterName(cluster) != nil:
			return Scope{}, fmt.Errorf("%q: %w", entry, tunnelv1.ValidateClusterName(cluster))
		case !hasNamespace:
			s.clusters[cluster] = true
		case len(validation.IsDNS1123Label(namespace)) > 0:
			return Scope{}, fmt.Errorf("%q: namespace %q is not a DNS-1123 label", entry, namespace)
		default:
			s.namespaces[entry] = true
		}
		if !slices.Contains(s.entries, entry) {
			s.entries = append(s.entries, entry)
		}
	}
	return s, nil
}

// Contains reports whether the scope holds namespace of logical cluster
// cluster.
func (s Scope) Contains(cluster, namespace string) bool {
	return s.all || s.clusters[cluster] || s.namespaces[cluster+"/"+namespace]
}

// String is the scope as ParseScope reads it.
func (s Scope) String() string { return strings.Join(s.entries, ",") }
