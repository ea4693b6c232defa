# helm for the Deploy tests (test/deploy: helm lint, helm template and
# server-side dry runs of deploy/charts), pinned by a tool directive in
# test/tools/helm/go.mod, a module of its own so that helm's dependencies
# do not move the root or test modules' k8s.io versions, and built by
# build.sh there into .cache/helm-<version>-<sum>/ when missing (about three
# and a half minutes on 2 cores with an empty Go build cache, less once the
# workspace's packages it shares are compiled). The tests ask build.sh for
# the path.

# This file is included before the main Makefile's first target: keep its
# default goal.
ifeq ($(.DEFAULT_GOAL),)
.DEFAULT_GOAL := all
endif

.PHONY: helm-tools
## helm-tools: helm, pinned in test/tools/helm/go.mod, into .cache/helm-<version>-<sum>/ if missing; prints its path
helm-tools:
	@GO="$(GO)" test/tools/helm/build.sh

test: helm-tools
