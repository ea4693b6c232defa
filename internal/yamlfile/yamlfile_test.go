package yamlfile

import (
	"strings"
	"testing"
)

type inner struct {
	Name string `json:"name"`
}

type doc struct {
	Items []inner            `json:"items"`
	ByKey map[string][]inner `json:"byKey,omitempty"`
}

func TestUnmarshalNamesTheBadFieldsPath(t *testing.T) {
	for _, tc := range []struct{ yaml, want string }{
		{"items:\n- name: a\n- nmae: b\n", `items[1]: unknown field "nmae" (known: name)`},
		{"byKey:\n  x:\n  - name: a\n  - other: b\n", `byKey.x[1]: unknown field "other"`},
		{"item: []\n", `top level: unknown field "item"`},
		{"items: [\n", "YAML: "},
	} {
		var d doc
		err := Unmarshal([]byte(tc.yaml), &d)
		if err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "JSON") {
			t.Errorf("%q: got %v, want %q in YAML's words", tc.yaml, err, tc.want)
		}
	}
	var d doc
	if err := Unmarshal([]byte("items:\n- name: a\nbyKey:\n  x: [{name: b}]\n"), &d); err != nil || d.ByKey["x"][0].Name != "b" {
		t.Errorf("a good file: %v, %+v", err, d)
	}
}
