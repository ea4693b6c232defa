package deploy

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/kcp-dev/tunnel-broker/internal/release"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// TestDeployOverlaysDeployTheImagesOfThisVersion: every overlay that sets
// the tunnel's images sets the tag make images gives them, the VERSION
// file's, so that a release's manifests deploy that release's images.
func TestDeployOverlaysDeployTheImagesOfThisVersion(t *testing.T) {
	version := harness.Version(t)
	files, err := filepath.Glob(filepath.Join(deployDir(), "overlays", "*", "kustomization.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no overlays: %v", err)
	}
	seen := map[string]bool{}
	for _, f := range files {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var k struct {
			Images []struct {
				Name, NewName, NewTag, Digest string
			}
		}
		if err := yaml.Unmarshal(raw, &k); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		for _, i := range k.Images {
			if !slices.Contains(release.Images, i.Name) {
				continue
			}
			seen[i.Name] = true
			if i.NewTag != version {
				t.Errorf("%s: image %s has tag %q, want %s (VERSION)", f, i.Name, i.NewTag, version)
			}
		}
	}
	for _, name := range release.Images {
		if !seen[name] {
			t.Errorf("no overlay sets the tag of %s", name)
		}
	}
}
