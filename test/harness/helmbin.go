package harness

import "os"

var helmTool = cachedTool{name: "helm"}

// HelmBinary returns the path of helm, built by test/tools/helm/build.sh at
// the version pinned there and cached in the repo's .cache/: only the first
// call on a machine builds (a few minutes). $HELM, if it names an
// executable, is taken as it is.
func HelmBinary() (string, error) {
	if h := os.Getenv("HELM"); h != "" {
		if st, err := os.Stat(h); err == nil && st.Mode()&0o111 != 0 {
			return h, nil
		}
	}
	return helmTool.get()
}
