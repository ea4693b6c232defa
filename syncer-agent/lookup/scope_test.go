package lookup

import (
	"strings"
	"testing"
)

func TestScopeHoldsWhatItNames(t *testing.T) {
	type place struct{ cluster, namespace string }
	everywhere := []place{{"c1", "default"}, {"c1", "team"}, {"c2", "default"}, {"system:admin", "default"}}
	for _, c := range []struct {
		list string
		in   []place // the rest of everywhere is out
	}{
		{"", nil},
		{"*", everywhere},
		{"c1", []place{{"c1", "default"}, {"c1", "team"}}},
		{"c1/default", []place{{"c1", "default"}}},
		{" c1/team , c2 ,,", []place{{"c1", "team"}, {"c2", "default"}}},
		{"system:admin/default", []place{{"system:admin", "default"}}},
		{"c1/default,*", everywhere},
	} {
		s, err := ParseScope(c.list)
		if err != nil {
			t.Fatalf("ParseScope(%q): %v", c.list, err)
		}
		for _, p := range everywhere {
			want := false
			for _, in := range c.in {
				want = want || in == p
			}
			if got := s.Contains(p.cluster, p.namespace); got != want {
				t.Errorf("ParseScope(%q).Contains(%s, %s) = %v, want %v", c.list, p.cluster, p.namespace, got, want)
			}
		}
	}
}

func TestScopeRefusesBadEntries(t *testing.T) {
	for list, want := range map[string]string{
		"root:org":        `"root:org": logical cluster "root:org" is not a valid`,
		"c1,C2":           `"C2": logical cluster`,
		"c1/":             `"c1/": namespace "" is not a DNS-1123 label`,
		"/default":        `"/default": logical cluster ""`,
		"c1/Default":      `namespace "Default" is not`,
		"c1/default/more": `namespace "default/more" is not`,
		"*/default":       `"*" stands alone`,
	} {
		if _, err := ParseScope(list); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ParseScope(%q) = %v, want an error saying %s", list, err, want)
		}
	}
}

func TestScopeStringIsItsList(t *testing.T) {
	s, err := ParseScope(" c1/team , c2 ,c2,")
	if err != nil {
		t.Fatal(err)
	}
	if got := s.String(); got != "c1/team,c2" {
		t.Errorf("String() = %q", got)
	}
}
