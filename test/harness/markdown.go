package harness

import (
	"regexp"
	"strings"
)

var shellBlockRE = regexp.MustCompile("(?s)```sh\n(.*?)```")

// ShellBlocks returns the ```sh blocks of the section of markdown whose
// heading line is heading ("## Run it by hand"), up to the next "## "
// heading, in order: the commands a document asks its readers to run, for
// the tests that run them.
func ShellBlocks(t T, markdown, heading string) []string {
	t.Helper()
	start := strings.Index(markdown, "\n"+heading+"\n")
	if start < 0 {
		t.Fatalf("no %q section", heading)
	}
	body := markdown[start+len(heading)+2:]
	if end := strings.Index(body, "\n## "); end >= 0 {
		body = body[:end]
	}
	var out []string
	for _, b := range shellBlockRE.FindAllStringSubmatch(body, -1) {
		out = append(out, b[1])
	}
	return out
}
