// Package policy decides which SPIFFE IDs may do what on the broker: which
// agents may serve which logical clusters, which callers may dial which
// clusters, and which operators may use the admin RPCs. It is loaded from a
// file and validated at start.
package policy

import (
	"fmt"
	"os"
	"regexp"
	"strings"

	"github.com/kcp-dev/tunnel-broker/internal/yamlfile"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
)

// File is the policy file's format (YAML or JSON):
//
//	agents:
//	# One syncer per sync target; the template binds each to its clusters.
//	- id: spiffe://example.org/ns/kcp-syncer/sa/syncer-{syncTarget}
//	# A fixed identity with a fixed set of clusters.
//	- id: spiffe://example.org/ns/legacy/sa/agent
//	  clusters: [root]
//	syncTargets:
//	  us-east-1: [root, 2x3y4z5w6v7u8t9s]
//	callers:
//	- id: spiffe://example.org/ns/kcp/kcp-server  # any cluster
//	- id: spiffe://example.org/ns/team-a/sa/kcp-shard
//	  clusters: [2x3y4z5w6v7u8t9s]                # only these
//	operators:
//	- id: spiffe://example.org/ns/kcp-system/sa/oncall
//	egress:                                       # the CONNECT front end
//	- id: spiffe://example.org/ns/hcp-1/sa/kube-apiserver
//	  cluster: hcp-1                              # exactly one
type File struct {
	Agents      []AgentRule         `json:"agents"`
	SyncTargets map[string][]string `json:"syncTargets,omitempty"`
	Callers     []CallerRule        `json:"callers"`
	Operators   []OperatorRule      `json:"operators,omitempty"`
	Egress      []EgressRule        `json:"egress,omitempty"`
}

// EgressRule lets an ID use the broker's CONNECT front end over TLS, and
// says which logical cluster its connections go to: a CONNECT names only
// host:port, so the caller's identity decides the cluster, and each
// identity has exactly one.
type EgressRule struct {
	ID      string `json:"id"`
	Cluster string `json:"cluster"`
}

// AgentRule lets an ID register as an agent. An ID with the {syncTarget}
// placeholder serves the clusters listed for that sync target under
// syncTargets; a plain ID serves its own clusters list ("*" for any).
type AgentRule struct {
	ID       string   `json:"id"`
	Clusters []string `json:"clusters,omitempty"`
}

// CallerRule lets an ID call Dial, for the listed clusters or, when none are
// listed, for any.
type CallerRule struct {
	ID       string   `json:"id"`
	Clusters []string `json:"clusters,omitempty"`
}

// OperatorRule lets an ID call the admin RPCs.
type OperatorRule struct {
	ID string `json:"id"`
}

const placeholder = "{syncTarget}"

// A sync target's name as it can appear in a SPIFFE ID path segment.
var syncTargetRE = regexp.MustCompile(`^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$`)

// Policy is a validated policy.
type Policy struct {
	agents      []agentMatcher
	callers     []callerMatcher
	operators   map[spiffeid.ID]bool
	syncTargets map[string]clusterSet
	// warnings are rules that can never match, for the log.
	warnings []string
	egress   map[spiffeid.ID]string
}

// Warnings are the policy's rules that can never match: valid, but most
// likely not what was meant. The broker logs them at start.
func (p *Policy) Warnings() []string { return p.warnings }

type agentMatcher struct {
	exact    spiffeid.ID
	template *regexp.Regexp // set for templates; captures the sync target
	clusters clusterSet     // for exact IDs
}

type callerMatcher struct {
	id       spiffeid.ID
	clusters clusterSet
}

// clusterSet is a set of cluster names; any means "*". A map, so that
// checking a registration of n clusters against a sync target of m costs n
// lookups, not n scans of m names.
type clusterSet struct {
	any   bool
	names map[string]struct{}
}

func (s clusterSet) has(c string) bool {
	if s.any {
		return true
	}
	_, ok := s.names[c]
	return ok
}

// Load reads and validates a policy file; its errors name the file.
func Load(path string) (*Policy, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	p, err := Parse(raw)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return p, nil
}

// Parse validates a policy, naming the first bad field by its path
// (agents[0].clusters).
func Parse(raw []byte) (*Policy, error) {
	var f File
	if err := yamlfile.Unmarshal(raw, &f); err != nil {
		return nil, err
	}
	return New(f)
}

// New validates f.
func New(f File) (*Policy, error) {
	var err error
	p := &Policy{operators: map[spiffeid.ID]bool{}}
	syncTargets := map[string]clusterSet{}
	for name, clusters := range f.SyncTargets {
		if !syncTargetRE.MatchString(name) {
			return nil, fmt.Errorf("syncTargets: %q is not a sync target name", name)
		}
		set, err := parseClusters(clusters, false)
		if err != nil {
			return nil, fmt.Errorf("syncTargets.%s: %w", name, err)
		}
		syncTargets[name] = set
	}
	for i, r := range f.Agents {
		m, err := newAgentMatcher(r)
		if err != nil {
			return nil, fmt.Errorf("agents[%d].%w", i, err)
		}
		p.agents = append(p.agents, m)
	}
	for i, r := range f.Callers {
		id, err := spiffeid.FromString(r.ID)
		if err != nil {
			return nil, fmt.Errorf("callers[%d].id: %w", i, err)
		}
		set := clusterSet{any: true}
		if len(r.Clusters) > 0 {
			if set, err = parseClusters(r.Clusters, true); err != nil {
				return nil, fmt.Errorf("callers[%d].clusters: %w", i, err)
			}
		}
		p.callers = append(p.callers, callerMatcher{id: id, clusters: set})
	}
	for i, r := range f.Operators {
		id, err := spiffeid.FromString(r.ID)
		if err != nil {
			return nil, fmt.Errorf("operators[%d].id: %w", i, err)
		}
		p.operators[id] = true
	}
	if p.egress, err = parseEgress(f.Egress); err != nil {
		return nil, err
	}
	if len(p.agents) == 0 {
		return nil, fmt.Errorf("agents: no rule, so no agent could register")
	}
	if len(p.callers) == 0 && len(p.egress) == 0 {
		return nil, fmt.Errorf("callers: no rule (nor egress), so nobody could dial")
	}
	p.syncTargets = syncTargets
	p.warnings = unmatchable(f)
	return p, nil
}

func newAgentMatcher(r AgentRule) (agentMatcher, error) {
	if !strings.Contains(r.ID, placeholder) {
		id, err := spiffeid.FromString(r.ID)
		if err != nil {
			return agentMatcher{}, fmt.Errorf("id: %w", err)
		}
		if len(r.Clusters) == 0 {
			return agentMatcher{}, fmt.Errorf("clusters: an agent ID without %s needs the clusters it may serve (\"*\" for any)", placeholder)
		}
		set, err := parseClusters(r.Clusters, true)
		if err != nil {
			return agentMatcher{}, fmt.Errorf("clusters: %w", err)
		}
		return agentMatcher{exact: id, clusters: set}, nil
	}
	if strings.Count(r.ID, placeholder) != 1 {
		return agentMatcher{}, fmt.Errorf("id: %s may appear once", placeholder)
	}
	if len(r.Clusters) > 0 {
		return agentMatcher{}, fmt.Errorf("clusters: a template's clusters come from syncTargets")
	}
	// The placeholder must sit in the path, where the SPIFFE ID is still
	// valid with a sync target name in its place.
	example, err := spiffeid.FromString(strings.Replace(r.ID, placeholder, "x", 1))
	if err != nil {
		return agentMatcher{}, fmt.Errorf("id: %w", err)
	}
	if !strings.Contains(example.Path(), "x") || !strings.HasPrefix(r.ID, "spiffe://"+example.TrustDomain().Name()+"/") ||
		strings.Contains(example.TrustDomain().Name(), placeholder) {
		return agentMatcher{}, fmt.Errorf("id: %s must be in the path", placeholder)
	}
	before, after, _ := strings.Cut(r.ID, placeholder)
	re := regexp.MustCompile("^" + regexp.QuoteMeta(before) + `([a-z0-9]([a-z0-9.-]*[a-z0-9])?)` + regexp.QuoteMeta(after) + "$")
	return agentMatcher{template: re}, nil
}

func parseClusters(names []string, allowAny bool) (clusterSet, error) {
	set := clusterSet{names: make(map[string]struct{}, len(names))}
	for _, c := range names {
		if c == "*" {
			if !allowAny {
				return clusterSet{}, fmt.Errorf(`"*" is not allowed here`)
			}
			set.any = true
			continue
		}
		if err := tunnelv1.ValidateClusterName(c); err != nil {
			return clusterSet{}, err
		}
		set.names[c] = struct{}{}
	}
	return set, nil
}

// parseEgress validates the egress rules: one cluster per ID, each ID once.
func parseEgress(rules []EgressRule) (map[spiffeid.ID]string, error) {
	egress := map[spiffeid.ID]string{}
	for i, r := range rules {
		id, err := spiffeid.FromString(r.ID)
		if err != nil {
			return nil, fmt.Errorf("egress[%d].id: %w", i, err)
		}
		if err := tunnelv1.ValidateClusterName(r.Cluster); err != nil {
			return nil, fmt.Errorf("egress[%d].cluster: %w", i, err)
		}
		if _, dup := egress[id]; dup {
			return nil, fmt.Errorf("egress[%d].id: %s has a rule already: an egress caller goes to exactly one logical cluster", i, id)
		}
		egress[id] = r.Cluster
	}
	return egress, nil
}
