package deploy

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	"sigs.k8s.io/yaml"

	"github.com/kcp-dev/tunnel-broker/internal/release"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// TestDeployOverlaysDeployTheImagesOfThisVersion: every overlay that sets
// the tunnel's images sets the tag make images gives them, the VERSION
// file's, so that a release's manifests deploy that release's images; and
// the containers it renders run them with that tag, which they do only if
// the bases name the images as make images does (kustomize changes only
// the images whose name an images: entry gives).
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
		overlay := filepath.Join("overlays", filepath.Base(filepath.Dir(f)))
		_, objs := render(t, overlay)
		for _, o := range ofKind(objs, "Deployment") {
			var d appsv1.Deployment
			o.into(t, &d)
			for _, c := range d.Spec.Template.Spec.Containers {
				_, name, _ := imageHost(imageRepository(c.Image))
				if !slices.ContainsFunc(release.Images, func(i string) bool { _, n, _ := imageHost(i); return n == name }) {
					continue
				}
				if !strings.HasSuffix(c.Image, ":"+version) {
					t.Errorf("deploy/%s: %s runs %s, want the tag %s of its images: entry, which applies only to a base naming the image as one of %v",
						overlay, o, c.Image, version, release.Images)
				}
			}
		}
	}
	for _, name := range release.Images {
		if !seen[name] {
			t.Errorf("no overlay sets the tag of %s", name)
		}
	}
}

// TestDeployHelmChartsDeployTheImagesOfThisVersion: every chart's
// appVersion, the default tag of its image, is the VERSION file's, and its
// version the same without the v (make release sets both), and the chart's
// image is one make images builds.
func TestDeployHelmChartsDeployTheImagesOfThisVersion(t *testing.T) {
	version := harness.Version(t)
	for _, chart := range charts {
		raw, err := os.ReadFile(filepath.Join(chartDir(chart), "Chart.yaml"))
		if err != nil {
			t.Fatal(err)
		}
		var c struct{ Version, AppVersion string }
		if err := yaml.Unmarshal(raw, &c); err != nil {
			t.Fatalf("%s: %v", chart, err)
		}
		if c.AppVersion != version {
			t.Errorf("%s: appVersion %q, want %s (VERSION)", chart, c.AppVersion, version)
		}
		if want := strings.TrimPrefix(version, "v"); c.Version != want {
			t.Errorf("%s: version %q, want %s (VERSION without its v)", chart, c.Version, want)
		}
		if stamped := release.StampChart(string(raw), version); stamped != string(raw) {
			t.Errorf("%s: make release would change Chart.yaml:\n%s", chart, stamped)
		}
		raw, err = os.ReadFile(filepath.Join(chartDir(chart), "values.yaml"))
		if err != nil {
			t.Fatal(err)
		}
		var v struct {
			Image struct{ Repository, Tag string }
		}
		if err := yaml.Unmarshal(raw, &v); err != nil {
			t.Fatalf("%s: %v", chart, err)
		}
		if !slices.Contains(release.Images, v.Image.Repository) || v.Image.Tag != "" {
			t.Errorf("%s: image %s:%s, want one of %v with the appVersion's tag", chart, v.Image.Repository, v.Image.Tag, release.Images)
		}
	}
}
