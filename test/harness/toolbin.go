package harness

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
)

// cachedTool is a heavy test tool built by test/tools/<name>/build.sh (or
// script, relative to the repository) from the versions pinned there and
// cached in the repo's .cache/: only the first build on a machine takes
// minutes. The script prints the path the tests use.
type cachedTool struct {
	name   string
	script string
	once   sync.Once
	path   string
	err    error
}

// get runs the tool's build script once, and returns what it printed.
func (c *cachedTool) get() (string, error) {
	c.once.Do(func() {
		_, self, _, ok := runtime.Caller(0)
		if !ok {
			c.err = fmt.Errorf("cannot locate the harness source to find %s's build script", c.name)
			return
		}
		script := filepath.Join(filepath.Dir(self), "..", "tools", c.name, "build.sh")
		if c.script != "" {
			script = filepath.Join(filepath.Dir(self), "..", "..", c.script)
		}
		cmd := exec.Command(script)
		cmd.Stderr = os.Stderr // the build says what it does; go test shows it
		out, err := cmd.Output()
		if err != nil {
			c.err = fmt.Errorf("%s: %w", script, err)
			return
		}
		c.path = strings.TrimSpace(string(out))
	})
	return c.path, c.err
}
