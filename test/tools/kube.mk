# kube-apiserver and etcd for the KubeAPIServer tests (test/kubeapiserver),
# and kubectl for the Deploy tests (test/deploy: kubectl kustomize, and
# server-side dry runs against that kube-apiserver), built from the versions
# pinned in test/tools/kube/go.mod and cached in .cache/kube/ (the first
# build takes many minutes; later runs reuse it).
# The tests run in a network namespace of their own: they need unshare
# (util-linux) and ip (iproute2).

# An included rule must not become the default goal.
ifeq ($(.DEFAULT_GOAL),)
.DEFAULT_GOAL := all
endif

.PHONY: kube-tools
## kube-tools: build (or find cached) kube-apiserver, kubectl and etcd, install ip and unshare if missing
kube-tools:
	@command -v ip >/dev/null 2>&1 && command -v unshare >/dev/null 2>&1 || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 util-linux; }
	test/tools/kube/build.sh

test: kube-tools
