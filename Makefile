# The front door. Every tool comes from the Go module proxy through go.mod's
# tool directives (buf, protoc-gen-go, protoc-gen-go-grpc, grpcurl).
GO      ?= go
BIN     := $(CURDIR)/bin
MODULES := ./... ./kcpplugin/... ./proto/... ./test/...
export TUNNEL_BIN_DIR := $(BIN)
export GRPCURL        := $(BIN)/grpcurl

# The version of this tree (VERSION: the next release with -dev on main, the
# release itself on a release commit) and the commit it is built from, with
# -dirty for uncommitted changes, stamped into every binary (--version, the
# build_info metric) and image. A plain go build reports what the toolchain
# recorded instead (internal/version).
VERSION ?= $(shell cat VERSION)
COMMIT  ?= $(shell git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)$(shell git diff --quiet HEAD -- 2>/dev/null || echo -dirty)
STAMP   := -X github.com/kcp-dev/tunnel-broker/internal/version.version=$(VERSION) \
           -X github.com/kcp-dev/tunnel-broker/internal/version.commit=$(COMMIT)

.PHONY: all help build tools demo test unit lint generate check-generated release-check images release clean

# Heavier test tools (kube-apiserver, etcd, SPIRE) have makefiles of their own.
-include test/tools/*.mk

all: build

## help: this list: every target with its one-line doc
help:
	@awk '/^## [a-z][a-z-]*: / { line = substr($$0, 4); name = line; sub(/:.*/, "", name); sub(/^[^:]*: /, "", line); \
	    printf "  %-16s %s\n", name, line; next } \
	  /^## / { printf "  %-16s %s\n", "", substr($$0, 4) }' $(MAKEFILE_LIST)

## build: the broker, syncer-agent and tunnelctl binaries, into bin/
build:
	$(GO) build -ldflags "$(STAMP)" -o $(BIN)/ ./broker ./syncer-agent ./broker/cmd/tunnelctl

## tools: grpcurl, for tests and for people, into bin/
tools:
	$(GO) build -o $(BIN)/ github.com/fullstorydev/grpcurl/cmd/grpcurl

## demo: broker, agent and a TLS webhook on loopback, one admission round trip
demo: build
	$(GO) run ./test/cmd/demo

## test: everything CI checks
# The first run builds the release check's consumer modules and the images
# from nothing: a package can take more than go test's default 10 minutes.
# go test starts packages in the order named: the two that take longest
# (kcp's, and the release check's modules built from nothing) go first, so
# that the rest runs beside them rather than after them.
SLOWEST := ./test/realkcp ./test/release
test: lint check-generated build tools
	$(GO) test -race -count=1 -timeout 45m $(SLOWEST) $(MODULES)

## release-check: the modules served at $(VERSION) by a local module proxy; a
## kcp-shaped module outside the repository go gets kcpplugin from it, on the
## oldest and the newest k8s.io/apiserver kcpplugin supports, and calls a
## webhook through the tunnel (make test runs it too, with ./test/...)
release-check: build
	cd test && RELEASE_VERSION=$(VERSION) $(GO) test -count=1 -timeout 45m -run Release ./release/

## images: OCI images of the broker, the syncer-agent, kcp with the tunnel and
## tunnelctl, localhost/kcp-dev/tunnel-broker:$(VERSION),
## localhost/kcp-dev/tunnel-syncer-agent:$(VERSION),
## localhost/kcp-dev/tunnel-kcp:$(VERSION) (deploy/kcp, this machine's
## architecture only) and localhost/kcp-dev/tunnelctl:$(VERSION)
## (internal/release/images.go names them),
## without a container engine: static binaries on an empty base, as user 65532,
## into $(IMAGES)/oci (an OCI layout) and $(IMAGES)/<binary>.tar (OCI archives,
## for skopeo, podman load, crane push or containerd's import)
IMAGES     ?= $(BIN)/images
IMAGE_ARCH ?= $(shell $(GO) env GOARCH)
images:
	CGO_ENABLED=0 GOOS=linux GOARCH=$(IMAGE_ARCH) $(GO) build -trimpath -ldflags "-s -w $(STAMP)" \
	  -o $(IMAGES)/linux_$(IMAGE_ARCH)/ ./broker ./syncer-agent ./broker/cmd/tunnelctl
	@if [ "$(IMAGE_ARCH)" = "$$($(GO) env GOHOSTARCH)" ]; then \
	  kcp=$$(deploy/kcp/build.sh) && cp "$$kcp" $(IMAGES)/linux_$(IMAGE_ARCH)/kcp; \
	else echo "images: localhost/kcp-dev/tunnel-kcp is built for this machine's architecture only"; fi
	$(GO) run ./internal/release/cmd/images --bin $(IMAGES)/linux_$(IMAGE_ARCH) --out $(IMAGES) \
	  --version $(VERSION) --revision $(COMMIT) --arch $(IMAGE_ARCH)

## release: make release VERSION=vX.Y.Z stamps the version, runs make test on
## it (RELEASE_CHECKS= to choose other targets), commits and tags proto/vX.Y.Z,
## kcpplugin/vX.Y.Z and vX.Y.Z, builds the images, opens the next -dev
## version, and prints what to push; it pushes nothing
RELEASE_CHECKS ?= test
release:
	@test "$(origin VERSION)" = "command line" || { echo "usage: make release VERSION=vX.Y.Z"; exit 2; }
	$(GO) run ./internal/release/cmd/release -version $(VERSION) -checks "$(RELEASE_CHECKS)"

## unit: the fast tests only (no binaries)
unit:
	$(GO) test -count=1 ./... ./kcpplugin/... ./proto/...

# buf breaking compares proto/ with the last release, the newest proto/v*
# tag reachable from HEAD; before the first release, with the commit this
# branch left main at (on main itself: HEAD, so uncommitted changes count).
PROTO_BASELINE ?= $(shell git describe --tags --abbrev=0 --match 'proto/v*' 2>/dev/null || \
                    git merge-base HEAD main 2>/dev/null || git rev-parse HEAD)

## lint: buf lint, buf breaking (docs/compatibility.md), go vet and gofmt
lint:
	$(GO) tool buf lint
	$(GO) tool buf breaking --against '.git#ref=$(PROTO_BASELINE)'
	$(GO) vet $(MODULES)
	@out=$$(gofmt -l $$(git ls-files '*.go' | grep -v '\.pb\.go$$')); \
	  if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi

## generate: Go code from proto/, with the pinned plugins
generate:
	$(GO) tool buf generate

## check-generated: the committed generated code matches proto/
check-generated: generate
	@git diff --exit-code -- proto || (echo "generated code is stale: run make generate and commit"; exit 1)

clean:
	rm -rf $(BIN)
