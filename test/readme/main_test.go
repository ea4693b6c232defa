// Package readme runs the README's "Run it by hand" section as written,
// against the built binaries, so that its commands cannot rot. It runs in a
// network namespace of its own (harness.RunIsolated): the section uses fixed
// ports on loopback, which other tests on the machine may hold.
package readme

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/kcp-dev/tunnel-broker/test/harness"
)

func TestMain(m *testing.M) {
	os.Exit(harness.RunIsolated(m, buildTools, m.Run))
}

// buildTools builds the binaries and grpcurl before the tests enter the
// namespace (building may need the Go module proxy), and hands their
// places to the tests through $TUNNEL_BIN_DIR and $GRPCURL.
func buildTools() error {
	main := &harness.Main{}
	dir := harness.Binaries(main)
	if err := os.Setenv("TUNNEL_BIN_DIR", dir); err != nil {
		return err
	}
	if path := os.Getenv("GRPCURL"); path != "" {
		if _, err := os.Stat(path); err == nil {
			return nil
		}
	}
	out, err := exec.Command("go", "build", "-o", dir+"/", "github.com/fullstorydev/grpcurl/cmd/grpcurl").CombinedOutput()
	if err != nil {
		return fmt.Errorf("building grpcurl: %v\n%s", err, out)
	}
	return os.Setenv("GRPCURL", filepath.Join(dir, "grpcurl"))
}
