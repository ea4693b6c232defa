# The kcp of the RealKCP tests (test/realkcp) and of make images: deploy/kcp,
# kcp's server at the version pinned in deploy/kcp/go.mod with
# docs/kcp/webhook-tunnel.patch applied and the seam filled by kcpplugin,
# built by deploy/kcp/build.sh and cached in .cache/kcp/ (the first build
# takes 10-20 minutes on 2 cores; later runs reuse it, and a change to the
# patch, deploy/kcp or kcpplugin rebuilds from the warm Go build cache in a
# minute or two).
# The tests run in a network namespace of their own, as the KubeAPIServer
# tests do: kube-tools (kube.mk) installs ip and unshare.

# An included rule must not become the default goal.
ifeq ($(.DEFAULT_GOAL),)
.DEFAULT_GOAL := all
endif

.PHONY: kcp-tools
## kcp-tools: build (or find cached) kcp with the webhook tunnel (deploy/kcp), for the RealKCP tests and the image
kcp-tools:
	deploy/kcp/build.sh

.PHONY: kcp-seam
## kcp-seam: kcp's unit tests of the seam, in kcp's source with the patch and in the newest release's with its port (deploy/kcp/build.sh seam), if a patch or build.sh changed since deploy/kcp/seam.sum
kcp-seam:
	deploy/kcp/build.sh seam

test: kcp-tools kcp-seam
