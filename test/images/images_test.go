// Package images checks what make images builds: each image's config, its
// filesystem, the binary in it run with --version, and, where runc is
// installed, the image run as a container.
package images

import (
	"archive/tar"
	"debug/elf"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"go.uber.org/goleak"

	"github.com/kcp-dev/tunnel-broker/internal/release/image"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// built are the images make images writes, by binary, named in full: a
// name without a registry host is read as one on the default registry,
// which a cluster that loaded the archive would then try to pull.
var built = map[string]string{
	"broker":       "localhost/kcp-dev/tunnel-broker",
	"syncer-agent": "localhost/kcp-dev/tunnel-syncer-agent",
	"kcp":          "localhost/kcp-dev/tunnel-kcp",
	"tunnelctl":    "localhost/kcp-dev/tunnelctl",
}

func TestImagesRunTheirStampedBinaryAsNonRoot(t *testing.T) {
	out := t.TempDir()
	cmd := exec.Command("make", "-C", harness.RepoRoot(), "images", "IMAGES="+out)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("make images: %v\n%s", err, b)
	}
	version := harness.Version(t)
	oci, byName := ociImages(t, filepath.Join(out, "oci"))
	for binary, name := range built {
		t.Run(binary, func(t *testing.T) {
			digest, ok := byName[name+":"+version]
			if !ok {
				t.Fatalf("the OCI layout has no %s:%s (it has %v)", name, version, byName)
			}
			img, err := oci.Image(digest)
			if err != nil {
				t.Fatal(err)
			}
			cfg, revision := checkImageConfig(t, img, binary, version)
			rootfs, want := checkImageFiles(t, img, binary, version, revision)
			checkArchive(t, filepath.Join(out, binary+".tar"), name+":"+version)
			checkRunsAsContainer(t, rootfs, cfg.Config, name, want)
		})
	}
}

// ociImages opens the OCI layout at dir and returns its images' digests by
// reference name, checking that containerd's import reads the same name.
func ociImages(t *testing.T, dir string) (layout.Path, map[string]v1.Hash) {
	t.Helper()
	oci, err := layout.FromPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	index, err := oci.ImageIndex()
	if err != nil {
		t.Fatal(err)
	}
	manifest, err := index.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]v1.Hash{}
	for _, d := range manifest.Manifests {
		name := d.Annotations[image.RefNameAnnotation]
		if got := d.Annotations[image.ContainerdNameAnnotation]; got != name {
			t.Errorf("%s in the OCI layout: %s %q, want %q, its %s", d.Digest, image.ContainerdNameAnnotation, got, name, image.RefNameAnnotation)
		}
		byName[name] = d.Digest
	}
	return oci, byName
}

// checkImageConfig checks that img's config runs binary alone, as a
// non-root user, on this platform, labelled with version and a revision;
// it returns the config and the revision.
func checkImageConfig(t *testing.T, img v1.Image, binary, version string) (*v1.ConfigFile, string) {
	t.Helper()
	cfg, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	c := cfg.Config
	if !slices.Equal(c.Entrypoint, []string{"/" + binary}) || len(c.Cmd) != 0 {
		t.Errorf("entrypoint %q, cmd %q: want the binary alone", c.Entrypoint, c.Cmd)
	}
	if c.User != "65532:65532" {
		t.Errorf("user %q, want 65532:65532 (non-root)", c.User)
	}
	if cfg.OS != "linux" || cfg.Architecture != runtime.GOARCH {
		t.Errorf("platform %s/%s, want linux/%s", cfg.OS, cfg.Architecture, runtime.GOARCH)
	}
	revision := c.Labels["org.opencontainers.image.revision"]
	if c.Labels["org.opencontainers.image.version"] != version || revision == "" {
		t.Errorf("labels %v: want version %s and a revision", c.Labels, version)
	}
	return cfg, revision
}

// checkImageFiles checks img's filesystem: a static binary that says it is
// version at revision, and the non-root user in /etc/passwd. It returns
// the unpacked filesystem and what binary --version must print.
func checkImageFiles(t *testing.T, img v1.Image, binary, version, revision string) (rootfs string, want *regexp.Regexp) {
	t.Helper()
	rootfs = unpack(t, img)
	checkStatic(t, filepath.Join(rootfs, binary))
	if passwd, err := os.ReadFile(filepath.Join(rootfs, "etc", "passwd")); err != nil || !strings.Contains(string(passwd), ":65532:65532:") {
		t.Errorf("/etc/passwd has no user 65532: %v", err)
	}
	want = regexp.MustCompile(`^` + regexp.QuoteMeta(binary+" "+version+" (commit "+revision+", go") + `\S+\)\n$`)
	if binary == "kcp" {
		// kcp says its own version, as kcp's releases do: its fork's
		// Kubernetes version and kcp's (deploy/kcp/build.sh).
		want = regexp.MustCompile(`^kcp version v1\.\d+\.\d+\+kcp-v\d+\.\d+\.\d+\n$`)
	}
	got, err := exec.Command(filepath.Join(rootfs, binary), "--version").Output()
	if err != nil || !want.Match(got) {
		t.Errorf("/%s --version from the image's filesystem: %q, %v; want %s", binary, got, err, want)
	}
	return rootfs, want
}

// checkRunsAsContainer runs the unpacked image name with --version as a
// container, with runc (as root only), and checks what it prints.
func checkRunsAsContainer(t *testing.T, rootfs string, config v1.Config, name string, want *regexp.Regexp) {
	t.Helper()
	runc, err := exec.LookPath("runc")
	if err != nil || os.Getuid() != 0 {
		t.Logf("not running the image as a container: runc is not installed or not root (apt-get install runc)")
		return
	}
	got := runContainer(t, runc, rootfs, config, "--version")
	if !want.Match(got) {
		t.Errorf("runc run %s --version: %q, want %s", name, got, want)
	}
	t.Logf("runc run %s --version: %s", name, got)
}

// unpack writes the image's flattened filesystem into a folder.
func unpack(t *testing.T, img v1.Image) string {
	t.Helper()
	root := filepath.Join(t.TempDir(), "rootfs")
	rc := mutate.Extract(img)
	defer rc.Close()
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return root
		}
		if err != nil {
			t.Fatal(err)
		}
		if !filepath.IsLocal(h.Name) {
			t.Fatalf("the image holds %q, outside its root", h.Name)
		}
		p := filepath.Join(root, h.Name)
		switch h.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(p, 0o755); err != nil {
				t.Fatal(err)
			}
		case tar.TypeReg:
			if h.Uid != 0 || h.Gid != 0 {
				t.Errorf("%s is owned by %d:%d, want root, so that the user it runs as cannot change it", h.Name, h.Uid, h.Gid)
			}
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				t.Fatal(err)
			}
			f, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY|os.O_EXCL, os.FileMode(h.Mode).Perm())
			if err != nil {
				t.Fatal(err)
			}
			if _, err := io.Copy(f, tr); err != nil {
				t.Fatal(err)
			}
			f.Close()
		default:
			t.Errorf("%s: unexpected entry type %c", h.Name, h.Typeflag)
		}
	}
}

// checkStatic: the image has no libc, so the binary must need none.
func checkStatic(t *testing.T, path string) {
	t.Helper()
	f, err := elf.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			t.Errorf("%s has a program interpreter: it is not static", path)
		}
	}
}

// checkArchive: the OCI archive is an OCI layout that names the image, for
// skopeo and podman (its reference name) and for containerd's import.
func checkArchive(t *testing.T, archive, name string) {
	t.Helper()
	f, err := os.Open(archive)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err != nil {
			t.Fatalf("%s has no index.json: %v", archive, err)
		}
		if h.Name != "index.json" {
			continue
		}
		var index v1.IndexManifest
		if err := json.NewDecoder(tr).Decode(&index); err != nil {
			t.Fatal(err)
		}
		if len(index.Manifests) != 1 || index.Manifests[0].Annotations[image.RefNameAnnotation] != name ||
			index.Manifests[0].Annotations[image.ContainerdNameAnnotation] != name {
			t.Errorf("%s's index: %+v, want %s alone, named by %s and %s", archive, index.Manifests, name,
				image.RefNameAnnotation, image.ContainerdNameAnnotation)
		}
		return
	}
}

// runContainer runs the image's entrypoint with args in a runc container
// made from the unpacked filesystem and the image's config: its user, a
// read-only root, new namespaces, no network.
func runContainer(t *testing.T, runc, rootfs string, c v1.Config, args ...string) []byte {
	t.Helper()
	bundle := filepath.Dir(rootfs)
	if out, err := exec.Command(runc, "spec", "--bundle", bundle).CombinedOutput(); err != nil {
		t.Fatalf("runc spec: %v\n%s", err, out)
	}
	specFile := filepath.Join(bundle, "config.json")
	raw, err := os.ReadFile(specFile)
	if err != nil {
		t.Fatal(err)
	}
	var spec map[string]any
	if err := json.Unmarshal(raw, &spec); err != nil {
		t.Fatal(err)
	}
	var uid, gid int
	if _, err := fmt.Sscanf(c.User, "%d:%d", &uid, &gid); err != nil {
		t.Fatalf("user %q: %v", c.User, err)
	}
	process := spec["process"].(map[string]any)
	process["terminal"] = false
	process["args"] = append(slices.Clone(c.Entrypoint), args...)
	process["user"] = map[string]any{"uid": uid, "gid": gid}
	process["cwd"] = c.WorkingDir
	spec["root"] = map[string]any{"path": "rootfs", "readonly": true}
	raw, err = json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(specFile, raw, 0o644); err != nil {
		t.Fatal(err)
	}
	id := fmt.Sprintf("tunnel-image-test-%d", os.Getpid())
	cmd := exec.Command(runc, "run", "--bundle", bundle, id)
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("runc run: %v\n%s", err, stderr.String())
	}
	return []byte(stdout.String())
}
