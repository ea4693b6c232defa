package harness

var kubeTools = cachedTool{name: "kube"}

// KubeBinaries returns the folder that holds kube-apiserver and etcd, built
// by test/tools/kube/build.sh from the versions pinned there. The build is
// cached in the repo's .cache/kube/, so only the first call on a machine
// builds (many minutes); later ones find the binaries at once.
func KubeBinaries() (string, error) { return kubeTools.get() }
