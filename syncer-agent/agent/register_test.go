package agent

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"
)

func TestALongClusterListGoesInSeveralRegistersThatFitTheBrokersMessages(t *testing.T) {
	// The longest names there are: "system:" and 63 characters.
	var clusters []string
	for i := range 2*ClustersPerRegister + 1 {
		clusters = append(clusters, fmt.Sprintf("system:%s%05d", strings.Repeat("c", 58), i))
	}
	name := strings.Repeat("n", 63)
	msgs := registers(clusters, name)
	if len(msgs) != 3 {
		t.Fatalf("%d registers for %d clusters, want 3", len(msgs), len(clusters))
	}
	var got []string
	for i, m := range msgs {
		reg := m.GetRegister()
		if more, last := reg.GetMore(), i == len(msgs)-1; more == last {
			t.Errorf("register %d: more = %v, want %v", i, more, !last)
		}
		if reg.GetAgentName() != name {
			t.Errorf("register %d: agent_name %q", i, reg.GetAgentName())
		}
		// The broker's default --max-message-size.
		if n := proto.Size(m); n > 32<<10 {
			t.Errorf("register %d: %d bytes, more than 32 KiB", i, n)
		}
		got = append(got, reg.GetClusters()...)
	}
	if !slices.Equal(got, clusters) {
		t.Error("the registers do not add up to the clusters")
	}
	// No cluster (a sync target no workspace uses yet) is one register.
	if msgs := registers(nil, name); len(msgs) != 1 || msgs[0].GetRegister().GetMore() {
		t.Errorf("no cluster: %v, want one register without more", msgs)
	}
}
