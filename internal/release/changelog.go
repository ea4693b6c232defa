package release

import (
	"fmt"
	"strings"
)

const unreleased = "## Unreleased\n"

// StampChangelog turns the changelog's "## Unreleased" section into the
// release's, headed with version and date, and opens an empty one above it.
// It refuses a changelog whose Unreleased section is missing or says
// nothing: a release says what it brings.
func StampChangelog(changelog, version, date string) (string, error) {
	i := strings.Index(changelog, unreleased)
	if i < 0 {
		return "", fmt.Errorf("CHANGELOG.md has no %q section", strings.TrimSpace(unreleased))
	}
	body := changelog[i+len(unreleased):]
	if next := strings.Index(body, "\n## "); next >= 0 {
		body = body[:next]
	}
	if strings.TrimSpace(body) == "" {
		return "", fmt.Errorf("CHANGELOG.md: the Unreleased section is empty; say what %s brings", version)
	}
	return changelog[:i] + unreleased + "\n" + fmt.Sprintf("## %s (%s)\n", version, date) + changelog[i+len(unreleased):], nil
}
