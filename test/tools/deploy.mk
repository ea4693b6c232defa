# The Deploy tests (test/deploy): every kustomization in deploy/ rendered
# with kubectl kustomize, checked, and dry-run against a real kube-apiserver.
# make test runs them with everything else; kube-tools (kube.mk) builds
# kubectl and kube-apiserver for them.

# This file is included before the main Makefile's first target: keep its
# default goal.
ifeq ($(.DEFAULT_GOAL),)
.DEFAULT_GOAL := all
endif

.PHONY: deploy-check
## deploy-check: the Deploy tests alone (render, check and dry-run deploy/)
deploy-check: kube-tools helm-tools build
	cd test && $(GO) test -count=1 -run Deploy ./...
