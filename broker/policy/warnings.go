package policy

import (
	"fmt"
	"strings"
)

// unmatchable lists the rules of a valid policy that can never match: a
// {syncTarget} template with no syncTargets to bind it, sync targets no
// template names, and IDs listed twice in one section (their rules add up,
// which a reader of either entry alone would not expect).
func unmatchable(f File) []string {
	var warnings []string
	templates := 0
	for i, r := range f.Agents {
		if strings.Contains(r.ID, placeholder) {
			templates++
			if len(f.SyncTargets) == 0 {
				warnings = append(warnings, fmt.Sprintf("agents[%d].id: %s stands for a sync target, but syncTargets lists none, so no agent may serve any cluster under this rule", i, placeholder))
			}
		}
	}
	if templates == 0 && len(f.SyncTargets) > 0 {
		warnings = append(warnings, fmt.Sprintf("syncTargets: no agents[].id holds %s, so these sync targets bind no agent", placeholder))
	}
	ids := func(section string, n int, id func(int) string) {
		first := map[string]int{}
		for i := range n {
			if j, seen := first[id(i)]; seen {
				warnings = append(warnings, fmt.Sprintf("%s[%d].id: %s is listed already at %s[%d]; the two rules add up: merge them", section, i, id(i), section, j))
				continue
			}
			first[id(i)] = i
		}
	}
	ids("agents", len(f.Agents), func(i int) string { return f.Agents[i].ID })
	ids("callers", len(f.Callers), func(i int) string { return f.Callers[i].ID })
	ids("operators", len(f.Operators), func(i int) string { return f.Operators[i].ID })
	return warnings
}
