package harness

import (
	"os"
	"os/exec"
	"path/filepath"
)

// Grpcurl returns the grpcurl binary: $GRPCURL when set (make builds it into
// bin/), else one built from the version pinned in go.mod.
func Grpcurl(t T) string {
	t.Helper()
	if path := os.Getenv("GRPCURL"); path != "" {
		if _, err := os.Stat(path); err == nil {
			return path
		}
	}
	dir := t.TempDir()
	out, err := exec.Command("go", "build", "-o", dir+"/", "github.com/fullstorydev/grpcurl/cmd/grpcurl").CombinedOutput()
	if err != nil {
		t.Fatalf("building grpcurl: %v\n%s", err, out)
	}
	return filepath.Join(dir, "grpcurl")
}
