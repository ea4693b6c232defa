package harness

import (
	"os"
	"path/filepath"

	"sigs.k8s.io/yaml"

	"github.com/kcp-dev/tunnel-broker/broker/policy"
)

// DefaultPolicy is what tests get unless they bring their own: agents
// /agent/sync-target-1, /agent/sync-target-2 and /agent/silent may serve any
// cluster, /kcp may dial any, /operator administers, /kube-apiserver
// reaches cluster hcp through the CONNECT front end.
func DefaultPolicy() policy.File {
	td := "spiffe://" + TrustDomain
	return policy.File{
		Agents: []policy.AgentRule{
			{ID: td + "/agent/sync-target-1", Clusters: []string{"*"}},
			{ID: td + "/agent/sync-target-2", Clusters: []string{"*"}},
			{ID: td + "/agent/silent", Clusters: []string{"*"}},
		},
		Callers:   []policy.CallerRule{{ID: td + "/kcp"}},
		Operators: []policy.OperatorRule{{ID: td + "/operator"}},
		// A kube-apiserver whose egress selector uses the broker's CONNECT
		// front end over mTLS reaches logical cluster hcp.
		Egress: []policy.EgressRule{{ID: td + "/kube-apiserver", Cluster: "hcp"}},
	}
}

// policyFor validates f, or the default policy when f is nil.
func (e *Env) policyFor(f *policy.File) *policy.Policy {
	e.T.Helper()
	if f == nil {
		d := DefaultPolicy()
		f = &d
	}
	p, err := policy.New(*f)
	if err != nil {
		e.T.Fatal(err)
	}
	return p
}

// WritePolicy writes f (or the default policy) for a broker binary.
func (e *Env) WritePolicy(f *policy.File) string {
	e.T.Helper()
	if f == nil {
		d := DefaultPolicy()
		f = &d
	}
	raw, err := yaml.Marshal(f)
	if err != nil {
		e.T.Fatal(err)
	}
	path := filepath.Join(e.Dir, "policy.yaml")
	must(e.T, os.WriteFile(path, raw, 0o644))
	return path
}
