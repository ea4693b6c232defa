# helm for the Deploy tests (test/deploy: helm lint, helm template and
# server-side dry runs of deploy/charts), pinned by a tool directive in
# test/tools/helm/go.mod, a module of its own so that helm's dependencies
# do not move the root or test modules' k8s.io versions, and built by
# build.sh there into .cache/helm-<version>/ when missing (about three and
# a half minutes on 2 cores with an empty Go build cache).

# This file is included before the main Makefile's first target: keep its
# default goal.
ifeq ($(.DEFAULT_GOAL),)
.DEFAULT_GOAL := all
endif

HELM_VERSION := $(shell awk '$$1 == "helm.sh/helm/v4" { print $$2 }' test/tools/helm/go.mod)
export HELM := $(CURDIR)/.cache/helm-$(HELM_VERSION)/helm

.PHONY: helm-tools
## helm-tools: helm, pinned in test/tools/helm/go.mod, into .cache/helm-<version>/ if missing
helm-tools:
	@GO="$(GO)" test/tools/helm/build.sh >/dev/null

test: helm-tools
