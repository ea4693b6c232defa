package lookup

import (
	"encoding/json"
	"fmt"
	"sort"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/tools/cache"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// Annotations kcp's syncer puts on the downstream namespaces it creates. The
// kcp.dev one is what syncers wrote before kcp moved to the kcp.io domain.
const (
	NamespaceLocatorAnnotation       = "kcp.io/namespace-locator"
	LegacyNamespaceLocatorAnnotation = "kcp.dev/namespace-locator"
)

// SyncTarget names the sync target an agent belongs to. A name alone is not
// unique (one per workspace), so Cluster or UID must be set too; when both
// are, both must match.
type SyncTarget struct {
	Name string
	// Cluster is the logical cluster of the SyncTarget object, as the
	// locator's syncTarget.cluster (or, written by older syncers,
	// syncTarget.path) holds it.
	Cluster string
	UID     string
}

func (s SyncTarget) String() string {
	return fmt.Sprintf("sync target %s (cluster %q, uid %q)", s.Name, s.Cluster, s.UID)
}

// namespaceLocator is the JSON in the locator annotation.
type namespaceLocator struct {
	SyncTarget struct {
		Cluster string `json:"cluster"`
		Path    string `json:"path"`
		Name    string `json:"name"`
		UID     string `json:"uid"`
	} `json:"syncTarget"`
	Cluster   string `json:"cluster"`
	Namespace string `json:"namespace"`
}

// locatorOf returns the upstream (logical cluster, namespace) that ns mirrors
// for the sync target st, or ok false if ns is not one of st's namespaces.
// A namespace with a malformed locator is nobody's: it is never a target.
func locatorOf(ns *corev1.Namespace, st SyncTarget) (cluster, namespace string, ok bool) {
	raw, found := ns.Annotations[NamespaceLocatorAnnotation]
	if !found {
		raw, found = ns.Annotations[LegacyNamespaceLocatorAnnotation]
	}
	if !found {
		return "", "", false
	}
	var l namespaceLocator
	if err := json.Unmarshal([]byte(raw), &l); err != nil {
		return "", "", false
	}
	targetCluster := l.SyncTarget.Cluster
	if targetCluster == "" {
		targetCluster = l.SyncTarget.Path
	}
	if l.SyncTarget.Name != st.Name ||
		(st.Cluster != "" && targetCluster != st.Cluster) ||
		(st.UID != "" && l.SyncTarget.UID != st.UID) {
		return "", "", false
	}
	// Names the broker would refuse can never be dialed: keep them out of
	// Clusters so that one bad locator cannot break the registration.
	if tunnelv1.ValidateClusterName(l.Cluster) != nil || len(validation.IsDNS1123Label(l.Namespace)) > 0 {
		return "", "", false
	}
	return l.Cluster, l.Namespace, true
}

// hasLocator reports whether ns was made by a syncer for some sync target.
func hasLocator(ns *corev1.Namespace) bool {
	_, a := ns.Annotations[NamespaceLocatorAnnotation]
	_, b := ns.Annotations[LegacyNamespaceLocatorAnnotation]
	return a || b
}

// Informer indexes of the namespaces of this agent's sync target.
const (
	byUpstream = "upstream" // "<logical cluster>/<upstream namespace>"
	byCluster  = "cluster"  // "<logical cluster>"
)

func upstreamKey(cluster, namespace string) string { return cluster + "/" + namespace }

// namespaceIndexers index downstream namespaces by the upstream namespace
// they mirror, so a dial finds its namespace without listing them all.
func namespaceIndexers(st SyncTarget) cache.Indexers {
	locate := func(obj any) (string, string, bool) {
		ns, ok := obj.(*corev1.Namespace)
		if !ok {
			return "", "", false
		}
		return locatorOf(ns, st)
	}
	return cache.Indexers{
		byUpstream: func(obj any) ([]string, error) {
			if c, n, ok := locate(obj); ok {
				return []string{upstreamKey(c, n)}, nil
			}
			return nil, nil
		},
		byCluster: func(obj any) ([]string, error) {
			if c, _, ok := locate(obj); ok {
				return []string{c}, nil
			}
			return nil, nil
		},
	}
}

// namespaceMapper finds the downstream namespace of an upstream one.
type namespaceMapper interface {
	// downstream returns the namespace of the physical cluster that holds
	// the Services of t's namespace, or a gRPC status error.
	downstream(t *tunnelv1.Target) (string, error)
	// clusters are the logical clusters that have namespaces here, sorted.
	clusters() []string
	// upstream is the logical cluster and namespace that the namespace
	// of the physical cluster named ns holds the Services of, if any.
	upstream(ns string) (cluster, namespace string, ok bool)
}

// syncerNamespaces maps through the syncer's locator annotations.
type syncerNamespaces struct {
	indexer    cache.Indexer
	syncTarget SyncTarget
}

func (m *syncerNamespaces) downstream(t *tunnelv1.Target) (string, error) {
	objs, err := m.indexer.ByIndex(byUpstream, upstreamKey(t.GetCluster(), t.GetNamespace()))
	if err != nil {
		return "", status.Errorf(codes.Internal, "namespace index: %v", err)
	}
	switch len(objs) {
	case 0:
		return "", status.Errorf(codes.NotFound, "namespace %s of logical cluster %s is not synced to this physical cluster by %s",
			t.GetNamespace(), t.GetCluster(), m.syncTarget)
	case 1:
		return objs[0].(*corev1.Namespace).Name, nil
	default:
		names := make([]string, 0, len(objs))
		for _, o := range objs {
			names = append(names, o.(*corev1.Namespace).Name)
		}
		sort.Strings(names)
		return "", status.Errorf(codes.FailedPrecondition, "namespace %s of logical cluster %s is claimed by several namespaces of the physical cluster (%v); refusing to guess",
			t.GetNamespace(), t.GetCluster(), names)
	}
}

func (m *syncerNamespaces) upstream(ns string) (cluster, namespace string, ok bool) {
	obj, exists, err := m.indexer.GetByKey(ns)
	if err != nil || !exists {
		return "", "", false
	}
	return locatorOf(obj.(*corev1.Namespace), m.syncTarget)
}

func (m *syncerNamespaces) clusters() []string {
	cs := m.indexer.ListIndexFuncValues(byCluster)
	sort.Strings(cs)
	return cs
}

// plainNamespaces serves one logical cluster whose namespaces have the same
// names in the physical cluster: for clusters no syncer manages.
type plainNamespaces struct {
	indexer cache.Indexer
	cluster string
}

func (m *plainNamespaces) downstream(t *tunnelv1.Target) (string, error) {
	if t.GetCluster() != m.cluster {
		return "", status.Errorf(codes.NotFound, "this agent serves logical cluster %s only, not %s", m.cluster, t.GetCluster())
	}
	obj, exists, err := m.indexer.GetByKey(t.GetNamespace())
	if err != nil {
		return "", status.Errorf(codes.Internal, "namespace index: %v", err)
	}
	if !exists {
		return "", status.Errorf(codes.NotFound, "namespace %s does not exist in logical cluster %s", t.GetNamespace(), m.cluster)
	}
	// A syncer's namespace mirrors some other workspace's namespace: it is
	// not part of the plain cluster, whatever its name.
	if hasLocator(obj.(*corev1.Namespace)) {
		return "", status.Errorf(codes.PermissionDenied, "namespace %s belongs to a kcp syncer, not to logical cluster %s", t.GetNamespace(), m.cluster)
	}
	return t.GetNamespace(), nil
}

func (m *plainNamespaces) clusters() []string { return []string{m.cluster} }

func (m *plainNamespaces) upstream(ns string) (cluster, namespace string, ok bool) {
	obj, exists, err := m.indexer.GetByKey(ns)
	if err != nil || !exists || hasLocator(obj.(*corev1.Namespace)) {
		return "", "", false
	}
	return m.cluster, ns, true
}
