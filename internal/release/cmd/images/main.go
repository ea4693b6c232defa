// Command images packs the broker's, the syncer-agent's and kcp's (deploy/kcp)
// static binaries into OCI images (make images): no container engine, no registry, no base
// image pulled. It writes an OCI image layout holding every image, and an
// OCI archive per image.
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"runtime"

	"github.com/kcp-dev/tunnel-broker/internal/release"
	"github.com/kcp-dev/tunnel-broker/internal/release/image"
)

func main() {
	var (
		bin      = flag.String("bin", "", "folder with the static binaries, built for --os and --arch")
		out      = flag.String("out", "", "folder to write the OCI layout (out/oci) and archives (out/<binary>.tar) into")
		version  = flag.String("version", "", "image tag and version label")
		revision = flag.String("revision", "", "git commit, for the revision label")
		goos     = flag.String("os", "linux", "the binaries' GOOS")
		goarch   = flag.String("arch", runtime.GOARCH, "the binaries' GOARCH")
	)
	flag.Parse()
	if *bin == "" || *out == "" || *version == "" {
		fmt.Fprintln(os.Stderr, "images: --bin, --out and --version are required")
		os.Exit(2)
	}
	if err := os.RemoveAll(filepath.Join(*out, "oci")); err != nil {
		fail(err)
	}
	for _, i := range release.Built {
		if _, err := os.Stat(filepath.Join(*bin, i.Binary)); os.IsNotExist(err) && i == release.Kcp {
			// deploy/kcp builds for this machine's architecture only.
			continue
		}
		name := i.Name + ":" + *version
		img, err := image.Build(image.Spec{
			Binary: filepath.Join(*bin, i.Binary),
			Title:  i.Title, Version: *version, Revision: *revision, OS: *goos, Arch: *goarch,
		})
		if err != nil {
			fail(err)
		}
		archive := filepath.Join(*out, i.Binary+".tar")
		if err := image.Write(filepath.Join(*out, "oci"), archive, name, img); err != nil {
			fail(err)
		}
		digest, err := img.Digest()
		if err != nil {
			fail(err)
		}
		fmt.Printf("%s %s %s\n", name, digest, archive)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "images:", err)
	os.Exit(1)
}
