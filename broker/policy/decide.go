package policy

import (
	"fmt"
	"slices"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
)

// IsAgent reports whether id may register as an agent at all.
func (p *Policy) IsAgent(id spiffeid.ID) bool {
	for _, m := range p.agents {
		if m.matches(id) {
			return true
		}
	}
	return false
}

// IsCaller reports whether id may call Dial at all.
func (p *Policy) IsCaller(id spiffeid.ID) bool {
	for _, m := range p.callers {
		if m.id == id {
			return true
		}
	}
	return false
}

// IsOperator reports whether id may call the admin RPCs.
func (p *Policy) IsOperator(id spiffeid.ID) bool { return p.operators[id] }

// MayServe returns nil if id may serve every cluster in clusters, else an
// error naming the first it may not. The rules id matches are found once,
// so a list costs one map lookup per cluster and rule.
func (p *Policy) MayServe(id spiffeid.ID, clusters []string) error {
	sets := p.servable(id)
	for _, c := range clusters {
		if !slices.ContainsFunc(sets, func(s clusterSet) bool { return s.has(c) }) {
			return fmt.Errorf("%s may not serve logical cluster %q", id, c)
		}
	}
	return nil
}

// servable is the cluster sets of the agent rules id matches: a plain ID's
// own, a template's sync target's.
func (p *Policy) servable(id spiffeid.ID) []clusterSet {
	var sets []clusterSet
	for _, m := range p.agents {
		if m.template == nil {
			if m.exact == id {
				sets = append(sets, m.clusters)
			}
			continue
		}
		match := m.template.FindStringSubmatch(id.String())
		if match == nil {
			continue
		}
		if st, ok := p.syncTargets[match[1]]; ok {
			sets = append(sets, st)
		}
	}
	return sets
}

// MayDial returns nil if id may dial Services of cluster.
func (p *Policy) MayDial(id spiffeid.ID, cluster string) error {
	for _, m := range p.callers {
		if m.id == id && m.clusters.has(cluster) {
			return nil
		}
	}
	return fmt.Errorf("%s may not dial logical cluster %q", id, cluster)
}

func (m agentMatcher) matches(id spiffeid.ID) bool {
	if m.template != nil {
		return m.template.MatchString(id.String())
	}
	return m.exact == id
}

// EgressCluster is the one logical cluster whose Services id may reach
// through the CONNECT front end.
func (p *Policy) EgressCluster(id spiffeid.ID) (string, error) {
	if c, ok := p.egress[id]; ok {
		return c, nil
	}
	return "", fmt.Errorf("%s has no egress rule", id)
}
