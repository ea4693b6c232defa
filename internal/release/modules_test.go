package release

import (
	"strings"
	"testing"

	"golang.org/x/mod/modfile"
)

func TestStampRequiresTheRepositorysModulesAtTheReleaseVersion(t *testing.T) {
	in := []byte(`// a comment that stays
module github.com/kcp-dev/tunnel-broker/kcpplugin

go 1.25.0

require (
	github.com/kcp-dev/tunnel-broker/proto v0.0.0-00010101000000-000000000000
	google.golang.org/grpc v1.72.2
)
`)
	out, err := StampGoMod("go.mod", in, "v0.2.0")
	if err != nil {
		t.Fatal(err)
	}
	f, err := modfile.Parse("go.mod", out, nil)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, r := range f.Require {
		got[r.Mod.Path] = r.Mod.Version
	}
	if got[Root+"/proto"] != "v0.2.0" || got["google.golang.org/grpc"] != "v1.72.2" {
		t.Errorf("requirements after stamping: %v", got)
	}
	if !strings.Contains(string(out), "// a comment that stays") {
		t.Errorf("stamping lost the go.mod's comments:\n%s", out)
	}
}

func TestOnlyCanonicalV0AndV1VersionsCanBeReleased(t *testing.T) {
	for _, ok := range []string{"v0.1.0", "v0.1.0-dev", "v1.2.3", "v0.1.0-rc.1"} {
		if err := CheckVersion(ok); err != nil {
			t.Errorf("CheckVersion(%q): %v", ok, err)
		}
	}
	for _, bad := range []string{"0.1.0", "v0.1", "v2.0.0", "v0.1.0+build", "latest", ""} {
		if err := CheckVersion(bad); err == nil {
			t.Errorf("CheckVersion(%q) accepted it", bad)
		}
	}
}

func TestEachModuleIsTaggedUnderItsFolder(t *testing.T) {
	want := map[string]string{Root + "/proto": "proto/v0.1.0", Root + "/kcpplugin": "kcpplugin/v0.1.0", Root: "v0.1.0"}
	for _, m := range Modules {
		if got := m.Tag("v0.1.0"); got != want[m.Path] {
			t.Errorf("%s: tag %s, want %s", m.Path, got, want[m.Path])
		}
	}
}

func TestStampTagsRewritesOnlyTheTunnelsImages(t *testing.T) {
	in := `images:
# Pin by digest in a real installation.
- name: localhost/kcp-dev/tunnel-broker
  newName: registry.example.com/kcp-dev/tunnel-broker
  newTag: v0.1.0
- name: example.com/syncer
  newTag: v0.11.0
- name: localhost/kcp-dev/tunnel-syncer-agent
  newTag: dev
`
	want := `images:
# Pin by digest in a real installation.
- name: localhost/kcp-dev/tunnel-broker
  newName: registry.example.com/kcp-dev/tunnel-broker
  newTag: v0.2.0
- name: example.com/syncer
  newTag: v0.11.0
- name: localhost/kcp-dev/tunnel-syncer-agent
  newTag: v0.2.0
`
	if got := stampTags(in, "v0.2.0"); got != want {
		t.Errorf("got:\n%s\nwant:\n%s", got, want)
	}
}

func TestStampChangelogNamesTheReleaseAndOpensTheNext(t *testing.T) {
	in := "# Changelog\n\nIntro.\n\n## Unreleased\n\n- A change.\n\n## v0.1.0 (2026-01-01)\n\n- First.\n"
	got, err := StampChangelog(in, "v0.2.0", "2026-12-01")
	if err != nil {
		t.Fatal(err)
	}
	want := "# Changelog\n\nIntro.\n\n## Unreleased\n\n## v0.2.0 (2026-12-01)\n\n- A change.\n\n## v0.1.0 (2026-01-01)\n\n- First.\n"
	if got != want {
		t.Errorf("got:\n%s\nwant:\n%s", got, want)
	}
	if _, err := StampChangelog(got, "v0.3.0", "2026-12-02"); err == nil {
		t.Error("a release with an empty Unreleased section was accepted")
	}
	if _, err := StampChangelog("# Changelog\n", "v0.3.0", "2026-12-02"); err == nil {
		t.Error("a changelog without an Unreleased section was accepted")
	}
}
