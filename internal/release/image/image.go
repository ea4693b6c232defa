// Package image builds OCI images of the tunnel's binaries without a
// container engine or a registry: a static binary on an empty base, run as a
// non-root user, written as an OCI image layout and an OCI archive.
package image

import (
	"archive/tar"
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// User is the numeric user and group the images run as: distroless'
// nonroot, and the runAsUser of deploy/'s manifests.
const User = "65532:65532"

// Spec is one image.
type Spec struct {
	// Binary is the static binary to run; the image holds it as /<base name>.
	Binary string
	// Title, Version and Revision become the image's OCI labels.
	Title, Version, Revision string
	// Platform the binary was built for.
	OS, Arch string
}

// Build makes the image: one layer with the binary and the /etc/passwd and
// /etc/group entries of User, and a config whose entrypoint is the binary.
// Files and the config carry no build time, so the same binary makes the
// same image.
func Build(s Spec) (v1.Image, error) {
	bin, err := os.ReadFile(s.Binary)
	if err != nil {
		return nil, err
	}
	name := filepath.Base(s.Binary)
	layer, err := layerOf([]file{
		{path: "etc/passwd", mode: 0o644, data: []byte("root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n")},
		{path: "etc/group", mode: 0o644, data: []byte("root:x:0:\nnonroot:x:65532:\n")},
		{path: name, mode: 0o755, data: bin},
	})
	if err != nil {
		return nil, err
	}
	img, err := mutate.AppendLayers(mutate.MediaType(empty.Image, types.OCIManifestSchema1), layer)
	if err != nil {
		return nil, err
	}
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	cfg, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cfg = cfg.DeepCopy()
	cfg.OS, cfg.Architecture = s.OS, s.Arch
	cfg.Created = v1.Time{Time: time.Unix(0, 0).UTC()}
	cfg.Config = v1.Config{
		Entrypoint: []string{"/" + name},
		User:       User,
		WorkingDir: "/",
		Labels: map[string]string{
			"org.opencontainers.image.title":    s.Title,
			"org.opencontainers.image.version":  s.Version,
			"org.opencontainers.image.revision": s.Revision,
			"org.opencontainers.image.source":   "https://github.com/kcp-dev/tunnel-broker",
		},
	}
	return mutate.ConfigFile(img, cfg)
}

// RefNameAnnotation names an image in an OCI layout's index.
const RefNameAnnotation = "org.opencontainers.image.ref.name"

// ContainerdNameAnnotation names an image in an OCI layout's index for
// containerd: its import (ctr images import, kind load image-archive) takes
// the image's full name from it, and the kubelet then finds the image under
// the name the manifests give.
const ContainerdNameAnnotation = "io.containerd.image.name"

// Write adds img to the OCI image layout at dir (made if missing) under
// name, its full name with its tag, and writes the layout of img alone as
// the OCI archive archive, which skopeo copy oci-archive:, podman load,
// crane push and containerd's import take.
func Write(dir, archive, name string, img v1.Image) error {
	if err := os.RemoveAll(archive + ".layout"); err != nil {
		return err
	}
	for _, d := range []string{dir, archive + ".layout"} {
		p, err := layout.FromPath(d)
		if err != nil {
			if p, err = layout.Write(d, empty.Index); err != nil {
				return err
			}
		}
		if err := p.AppendImage(img, layout.WithAnnotations(map[string]string{RefNameAnnotation: name, ContainerdNameAnnotation: name})); err != nil {
			return err
		}
	}
	defer os.RemoveAll(archive + ".layout")
	return tarDir(archive+".layout", archive)
}

type file struct {
	path string
	mode int64
	data []byte
}

func layerOf(files []file) (v1.Layer, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	dirs := map[string]bool{}
	for _, f := range files {
		for d := filepath.Dir(f.path); d != "."; d = filepath.Dir(d) {
			if !dirs[d] {
				dirs[d] = true
				if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d + "/", Mode: 0o755, Format: tar.FormatPAX}); err != nil {
					return nil, err
				}
			}
		}
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: f.path, Mode: f.mode, Size: int64(len(f.data)), Format: tar.FormatPAX}); err != nil {
			return nil, err
		}
		if _, err := tw.Write(f.data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	data := buf.Bytes()
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(data)), nil
	}, tarball.WithMediaType(types.OCILayer))
}

// tarDir writes the files under dir into the tar file out, with paths
// relative to dir.
func tarDir(dir, out string) error {
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	tw := tar.NewWriter(f)
	err = filepath.Walk(dir, func(path string, info os.FileInfo, err error) error {
		if err != nil || path == dir {
			return err
		}
		rel, err := filepath.Rel(dir, path)
		if err != nil {
			return err
		}
		hdr, err := tar.FileInfoHeader(info, "")
		if err != nil {
			return err
		}
		hdr.Name = filepath.ToSlash(rel)
		if info.IsDir() {
			hdr.Name += "/"
		}
		hdr.ModTime, hdr.Uid, hdr.Gid, hdr.Uname, hdr.Gname = time.Unix(0, 0), 0, 0, "", ""
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if info.IsDir() {
			return nil
		}
		src, err := os.Open(path)
		if err != nil {
			return err
		}
		defer src.Close()
		_, err = io.Copy(tw, src)
		return err
	})
	if err == nil {
		err = tw.Close()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("writing %s: %w", out, err)
	}
	return nil
}
