package release

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
)

var (
	imageEntry = regexp.MustCompile(`^(\s*)- name:\s*(\S+)\s*$`)
	newTag     = regexp.MustCompile(`^(\s*)newTag:\s*\S+\s*$`)
)

// StampOverlays sets the tag of Images in every kustomization of
// deploy/overlays to version, so that the overlays of a release deploy the
// images make images built for it. It edits lines, keeping comments.
func StampOverlays(repo, version string) error {
	return stampFiles(filepath.Join(repo, "deploy", "overlays", "*", "kustomization.yaml"), func(k string) string {
		return stampTags(k, version)
	})
}

// stampFiles rewrites every file pattern matches with stamp, leaving those
// it does not change untouched.
func stampFiles(pattern string, stamp func(string) string) error {
	files, err := filepath.Glob(pattern)
	if err != nil {
		return err
	}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			return err
		}
		if stamped := stamp(string(data)); stamped != string(data) {
			if err := os.WriteFile(f, []byte(stamped), 0o644); err != nil {
				return err
			}
		}
	}
	return nil
}

// stampTags rewrites newTag in the images: entries that name one of Images.
func stampTags(kustomization, version string) string {
	lines := strings.SplitAfter(kustomization, "\n")
	ours := false
	for i, l := range lines {
		if m := imageEntry.FindStringSubmatch(strings.TrimRight(l, "\n")); m != nil {
			ours = isImage(m[2])
			continue
		}
		if m := newTag.FindStringSubmatch(strings.TrimRight(l, "\n")); m != nil && ours {
			lines[i] = m[1] + "newTag: " + version + "\n"
		}
	}
	return strings.Join(lines, "")
}

func isImage(name string) bool {
	for _, i := range Images {
		if name == i {
			return true
		}
	}
	return false
}
