package policy

import (
	"strings"
	"testing"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
)

const example = `
agents:
- id: spiffe://example.org/ns/kcp-syncer/sa/syncer-{syncTarget}
- id: spiffe://example.org/ns/legacy/sa/agent
  clusters: [root]
- id: spiffe://partner.org/agent
  clusters: ["*"]
syncTargets:
  us-east-1: [root, 2x3y4z5w6v7u8t9s]
  eu-west-1: [team-b]
callers:
- id: spiffe://example.org/ns/kcp/sa/kcp
- id: spiffe://example.org/ns/team-a/sa/kcp-shard
  clusters: [2x3y4z5w6v7u8t9s]
operators:
- id: spiffe://example.org/ns/kcp-system/sa/oncall
`

func id(s string) spiffeid.ID { return spiffeid.RequireFromString(s) }

func TestPolicyBindsSyncTargetTemplateToItsClusters(t *testing.T) {
	p, err := Parse([]byte(example))
	if err != nil {
		t.Fatal(err)
	}
	usEast := id("spiffe://example.org/ns/kcp-syncer/sa/syncer-us-east-1")
	for _, tc := range []struct {
		agent    spiffeid.ID
		clusters []string
		ok       bool
	}{
		{usEast, []string{"root"}, true},
		{usEast, []string{"root", "2x3y4z5w6v7u8t9s"}, true},
		{usEast, []string{}, true},
		{usEast, []string{"team-b"}, false}, // eu-west-1's cluster
		{usEast, []string{"root", "team-b"}, false},
		{id("spiffe://example.org/ns/kcp-syncer/sa/syncer-eu-west-1"), []string{"team-b"}, true},
		{id("spiffe://example.org/ns/kcp-syncer/sa/syncer-unknown"), []string{"root"}, false},
		{id("spiffe://example.org/ns/kcp-syncer/sa/syncer-us-east-1/extra"), []string{"root"}, false},
		{id("spiffe://example.org/ns/legacy/sa/agent"), []string{"root"}, true},
		{id("spiffe://example.org/ns/legacy/sa/agent"), []string{"team-b"}, false},
		{id("spiffe://partner.org/agent"), []string{"anything"}, true},
		{id("spiffe://example.org/ns/kcp/sa/kcp"), []string{"root"}, false}, // a caller, not an agent
	} {
		err := p.MayServe(tc.agent, tc.clusters)
		if (err == nil) != tc.ok {
			t.Errorf("MayServe(%s, %v) = %v, want ok=%v", tc.agent, tc.clusters, err, tc.ok)
		}
	}
	if !p.IsAgent(usEast) || p.IsAgent(id("spiffe://example.org/ns/kcp/sa/kcp")) {
		t.Error("IsAgent does not follow the rules")
	}
}

func TestPolicyLimitsCallersToTheirClusters(t *testing.T) {
	p, err := Parse([]byte(example))
	if err != nil {
		t.Fatal(err)
	}
	kcp := id("spiffe://example.org/ns/kcp/sa/kcp")
	shard := id("spiffe://example.org/ns/team-a/sa/kcp-shard")
	stranger := id("spiffe://example.org/ns/kcp/sa/other")
	for _, tc := range []struct {
		caller  spiffeid.ID
		cluster string
		ok      bool
	}{
		{kcp, "root", true},
		{kcp, "team-b", true},
		{shard, "2x3y4z5w6v7u8t9s", true},
		{shard, "root", false},
		{stranger, "root", false},
	} {
		if err := p.MayDial(tc.caller, tc.cluster); (err == nil) != tc.ok {
			t.Errorf("MayDial(%s, %s) = %v, want ok=%v", tc.caller, tc.cluster, err, tc.ok)
		}
	}
	if !p.IsCaller(shard) || p.IsCaller(stranger) {
		t.Error("IsCaller does not follow the rules")
	}
	if !p.IsOperator(id("spiffe://example.org/ns/kcp-system/sa/oncall")) || p.IsOperator(kcp) {
		t.Error("IsOperator does not follow the rules")
	}
}

func TestPolicyRefusesBadFilesWithTheFieldAtFault(t *testing.T) {
	callers := "callers: [{id: spiffe://example.org/kcp}]\n"
	agents := "agents: [{id: spiffe://example.org/agent, clusters: [root]}]\n"
	for _, tc := range []struct {
		name, file, want string
	}{
		{"unknown field", agents + callers + "operator: []\n", "unknown field"},
		{"no agents", callers, "agents: no rule"},
		{"no callers", agents, "callers: no rule"},
		{"agent id not SPIFFE", "agents: [{id: https://example.org/agent, clusters: [root]}]\n" + callers, "agents[0].id"},
		{"agent without clusters", "agents: [{id: spiffe://example.org/agent}]\n" + callers, "agents[0].clusters"},
		{"bad cluster name", "agents: [{id: spiffe://example.org/agent, clusters: [Root]}]\n" + callers, "agents[0].clusters"},
		{"cluster path", "agents: [{id: spiffe://example.org/agent, clusters: [\"root:org\"]}]\n" + callers, "agents[0].clusters"},
		{"template twice", "agents: [{id: \"spiffe://example.org/{syncTarget}/{syncTarget}\"}]\n" + callers, "once"},
		{"template in trust domain", "agents: [{id: \"spiffe://{syncTarget}.org/agent\"}]\n" + callers, "agents[0].id"},
		{"template with clusters", "agents: [{id: \"spiffe://example.org/{syncTarget}\", clusters: [root]}]\n" + callers, "come from syncTargets"},
		{"bad sync target", agents + callers + "syncTargets: {Bad_Name: [root]}\n", "syncTargets"},
		{"wildcard sync target cluster", agents + callers + "syncTargets: {a: [\"*\"]}\n", "syncTargets.a"},
		{"caller id", agents + "callers: [{id: spiffe://}]\n", "callers[0].id"},
		{"caller cluster", agents + "callers: [{id: spiffe://example.org/kcp, clusters: [\"-x\"]}]\n", "callers[0].clusters"},
		{"operator id", agents + callers + "operators: [{id: nope}]\n", "operators[0].id"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(tc.file))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error mentioning %q", err, tc.want)
			}
		})
	}
}

func TestPolicyMapsEachEgressCallerToOneCluster(t *testing.T) {
	p, err := Parse([]byte(`
agents:
- id: spiffe://example.org/agent
  clusters: ["*"]
egress:
- id: spiffe://example.org/hcp-1/kube-apiserver
  cluster: hcp-1
`))
	if err != nil {
		t.Fatalf("a policy with egress rules and no callers: %v", err)
	}
	if c, err := p.EgressCluster(spiffeid.RequireFromString("spiffe://example.org/hcp-1/kube-apiserver")); err != nil || c != "hcp-1" {
		t.Errorf("EgressCluster = %q, %v; want hcp-1", c, err)
	}
	if c, err := p.EgressCluster(spiffeid.RequireFromString("spiffe://example.org/other")); err == nil {
		t.Errorf("an ID without a rule got cluster %q", c)
	}
	if err := p.MayDial(spiffeid.RequireFromString("spiffe://example.org/hcp-1/kube-apiserver"), "hcp-1"); err == nil {
		t.Error("an egress rule let its ID call Dial")
	}
	for name, egress := range map[string]string{
		"two rules for one ID": "- {id: spiffe://example.org/a, cluster: c1}\n- {id: spiffe://example.org/a, cluster: c2}",
		"a path for a cluster": "- {id: spiffe://example.org/a, cluster: 'root:org'}",
		"no cluster":           "- {id: spiffe://example.org/a}",
		"a list of clusters":   "- {id: spiffe://example.org/a, cluster: [c1, c2]}",
		"no ID":                "- {cluster: c1}",
	} {
		if _, err := Parse([]byte("agents: [{id: spiffe://example.org/agent, clusters: ['*']}]\negress:\n" + egress)); err == nil {
			t.Errorf("%s: accepted", name)
		} else {
			t.Logf("%s: %v", name, err)
		}
	}
}
