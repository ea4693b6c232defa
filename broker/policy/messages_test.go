package policy

import (
	"strings"
	"testing"
)

// A bad policy is refused with the path of the bad field, in YAML's words.
func TestPolicyErrorsNameTheFieldsPath(t *testing.T) {
	for _, tc := range []struct{ name, policy, want string }{
		{"unknown field in a rule", "agents:\n- id: spiffe://example.org/a\n  cluster: [root]\ncallers:\n- id: spiffe://example.org/kcp\n",
			`agents[0]: unknown field "cluster" (known: clusters, id)`},
		{"unknown field in a later rule", "agents:\n- id: spiffe://example.org/a\n  clusters: [root]\ncallers:\n- id: spiffe://example.org/kcp\n- id: spiffe://example.org/x\n  cluster: [root]\n",
			`callers[1]: unknown field "cluster"`},
		{"unknown section", "agent:\n- id: spiffe://example.org/a\n", `top level: unknown field "agent"`},
		{"syntax", "agents:\n- id: [\n", "YAML: "},
		{"wrong type", "agents:\n- id: spiffe://example.org/a\n  clusters: root\ncallers:\n- id: spiffe://example.org/kcp\n", "YAML: cannot unmarshal string into field AgentRule.agents.clusters"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(tc.policy))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error with %q", err, tc.want)
			}
			if strings.Contains(err.Error(), "JSON") {
				t.Errorf("%v speaks of JSON; the file is YAML", err)
			}
		})
	}
}

// Rules that can never match as written are warned about, and a policy
// without them gets no warning.
func TestPolicyWarnsAboutRulesThatNeverMatch(t *testing.T) {
	p, err := Parse([]byte(example))
	if err != nil {
		t.Fatal(err)
	}
	if w := p.Warnings(); len(w) != 0 {
		t.Errorf("the example policy warns: %v", w)
	}
	for _, tc := range []struct{ name, policy, want string }{
		{"template without syncTargets", "agents:\n- id: spiffe://example.org/agent/{syncTarget}\ncallers:\n- id: spiffe://example.org/kcp\n",
			"agents[0].id: {syncTarget} stands for a sync target, but syncTargets lists none"},
		{"syncTargets without template", "agents:\n- id: spiffe://example.org/a\n  clusters: [root]\nsyncTargets:\n  dev: [root]\ncallers:\n- id: spiffe://example.org/kcp\n",
			"syncTargets: no agents[].id holds {syncTarget}"},
		{"duplicate caller", "agents:\n- id: spiffe://example.org/a\n  clusters: [root]\ncallers:\n- id: spiffe://example.org/kcp\n- id: spiffe://example.org/kcp\n  clusters: [root]\n",
			"callers[1].id: spiffe://example.org/kcp is listed already at callers[0]"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := Parse([]byte(tc.policy))
			if err != nil {
				t.Fatal(err)
			}
			if w := strings.Join(p.Warnings(), "\n"); !strings.Contains(w, tc.want) {
				t.Errorf("warnings %q, want %q", w, tc.want)
			}
		})
	}
}
