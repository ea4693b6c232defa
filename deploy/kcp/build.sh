#!/bin/sh
# Builds the kcp an operator runs (this folder's main.go: kcp's server with
# the webhook seam filled by kcpplugin) at the kcp version pinned in this
# folder's go.mod, with docs/kcp/webhook-tunnel.patch applied to kcp's
# source, unless that build is already cached, and prints the binary's path.
# One build serves the RealKCP tests and the image (make images): a static
# linux binary (CGO_ENABLED=0, -trimpath) for this machine's architecture.
#
#   build.sh        build (or find) the binary, print its path
#   build.sh test   go vet and go test this folder's module (the RealKCP
#                   tests do)
#   build.sh seam   kcp's unit tests of the packages the seam touches, in
#                   kcp's source with docs/kcp/webhook-tunnel.patch applied,
#                   and in the newest kcp release's with its port,
#                   docs/kcp/webhook-tunnel-$newest.patch (that release
#                   cannot be built here: below); then record both patches
#                   and this script in seam.sum. Nothing runs if seam.sum
#                   says they were checked already (make test runs this
#                   mode); "seam force" runs them whatever it says
#
# The cache lives in the repo's git-ignored .cache/kcp/ (or
# $KCP_TOOLS_CACHE), one folder per key: the kcp version and a hash of the
# patch, this folder's sources, go.mod and go.sum, and the sources of
# kcpplugin and proto.
#
# How: kcp's module source comes from the module cache (the Go module
# proxy), is copied, patched, and built in a module made of this folder
# (kcp's replace directives: k8s.io/* from kcp's fork of Kubernetes) with
# github.com/kcp-dev/kcp replaced by the patched copy.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${KCP_TOOLS_CACHE:-$repo/.cache/kcp}
patch=$repo/docs/kcp/webhook-tunnel.patch
mode=${1:-build}
# The newest kcp release. Its servers need
# github.com/kcp-dev/virtual-workspace-framework, a module of kcp's
# repository the Go module proxy does not serve; its other modules it serves.
newest=v0.32.3
cd "$here"
# This module is deliberately outside the repo's go.work. The sum database
# does not know some of kcp-dev's modules: go.sum pins what was first seen.
export GOWORK=off GONOSUMDB=github.com/kcp-dev GOFLAGS=-buildvcs=false
export CGO_ENABLED=0

kcp=$(go list -m -f '{{.Version}}' github.com/kcp-dev/kcp)
key=$(
	cd "$repo"
	{
		cat "$patch"
		find deploy/kcp kcpplugin proto -type f \( -name '*.go' ! -name '*_test.go' -o -name go.mod -o -name go.sum -o -name build.sh \) | LC_ALL=C sort | xargs cat
	} | sha256sum | cut -c1-12
)
dir=$cache/kcp-$kcp-$key

# patched_kcp copies kcp $1's module source (from the module cache) to
# $build/kcp and applies patch $2 to it.
patched_kcp() {
	src=$(go mod download -json "github.com/kcp-dev/kcp@$1" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
	[ -d "$src" ] || { echo "kcp $1: no module source in the module cache" >&2; exit 1; }
	cp -R "$src" "$build/kcp"
	chmod -R u+w "$build/kcp"
	# git apply, in a repository of the copy's own (patch(1) may be
	# missing; the copy lies inside this repository's work tree).
	(cd "$build/kcp" && git init -q && git apply "$2" && rm -rf .git)
}

# prepare makes $build: kcp's patched source in $build/kcp and this folder's
# module beside it, with kcp, kcpplugin and proto replaced by local copies.
prepare() {
	rm -rf "$build"
	mkdir -p "$build"
	patched_kcp "$kcp" "$patch"
	tar -C "$here" --exclude build.sh -cf - . | tar -C "$build" -xf -
	(
		cd "$build"
		go mod edit \
			-replace "github.com/kcp-dev/kcp=./kcp" \
			-replace "github.com/kcp-dev/tunnel-broker/kcpplugin=$repo/kcpplugin" \
			-replace "github.com/kcp-dev/tunnel-broker/proto=$repo/proto"
	)
}

if [ "$mode" = test ]; then
	build=$(mktemp -d "${TMPDIR:-/tmp}/kcp-test.XXXXXX")
	trap 'rm -rf "$build"' EXIT
	prepare
	cd "$build"
	# The build's flags (CGO_ENABLED=0, -trimpath), so that the packages
	# the binary's build compiled are taken from the build cache.
	echo "deploy/kcp with kcp $kcp: go vet and its tests" >&2
	go vet -trimpath ./...
	go test -count=1 -trimpath ./...
	exit 0
fi

# newest_seam checks the port of the seam to the newest kcp release, which
# cannot be built here, in $build: it applies, and kcp's unit tests of the
# admission plugins and the conversion factory pass.
newest_seam() {
	echo "kcp $newest with docs/kcp/webhook-tunnel-$newest.patch: it applies; kcp's tests of the admission plugins and the conversion factory" >&2
	patched_kcp "$newest" "$repo/docs/kcp/webhook-tunnel-$newest.patch"
	# A stub of the one package of virtual-workspace-framework that the
	# admission plugins import (through the built-in schemas of APIExports):
	# the same types, and no built-in schemas. Everything else kcp's module
	# replaces with its staging folders is served, at the release's tags.
	stub=$build/virtual-workspace-framework
	mkdir -p "$stub/pkg/internalapis"
	printf 'module github.com/kcp-dev/virtual-workspace-framework\n\ngo 1.26.0\n' >"$stub/go.mod"
	cat >"$stub/pkg/internalapis/stub.go" <<-'STUB'
		// Package internalapis stands in for kcp's, which the Go module proxy
		// does not serve: it knows no built-in API.
		package internalapis

		import (
			apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
			"k8s.io/apimachinery/pkg/runtime"
			"k8s.io/apimachinery/pkg/runtime/schema"
			"k8s.io/kube-openapi/pkg/common"

			apisv1alpha1 "github.com/kcp-dev/sdk/apis/apis/v1alpha1"
		)

		type InternalAPI struct {
			Names         apiextensionsv1.CustomResourceDefinitionNames
			GroupVersion  schema.GroupVersion
			Instance      runtime.Object
			ResourceScope apiextensionsv1.ResourceScope
			HasStatus     bool
		}

		func CreateAPIResourceSchemas([]*runtime.Scheme, []common.GetOpenAPIDefinitions, ...InternalAPI) (map[apisv1alpha1.GroupResource]*apisv1alpha1.APIResourceSchema, error) {
			return nil, nil
		}
	STUB
	# The conversion factory is in kcp's server package, which needs all of
	# virtual-workspace-framework: its files (the patch's and kcp's
	# converter factory it wraps) are checked in a package of their own.
	mkdir -p "$build/kcp/pkg/server/conversioncheck"
	for f in webhook_conversion.go webhook_conversion_test.go conversion_webhook.go; do
		mv "$build/kcp/pkg/server/$f" "$build/kcp/pkg/server/conversioncheck/"
	done
	cd "$build/kcp"
	go mod edit \
		-replace "github.com/kcp-dev/apimachinery/v2=github.com/kcp-dev/apimachinery/v2@v2${newest#v0}" \
		-replace "github.com/kcp-dev/client-go=github.com/kcp-dev/client-go@$newest" \
		-replace "github.com/kcp-dev/sdk=github.com/kcp-dev/sdk@$newest" \
		-replace "github.com/kcp-dev/code-generator/v3=github.com/kcp-dev/code-generator/v3@v3${newest#v0}" \
		-replace "github.com/kcp-dev/virtual-workspace-framework=$stub"
	pkgs="./pkg/admission/initializers ./pkg/admission/validatingwebhook ./pkg/admission/mutatingwebhook ./pkg/server/conversioncheck"
	GOFLAGS="$GOFLAGS -mod=mod" go vet -trimpath $pkgs
	GOFLAGS="$GOFLAGS -mod=mod" go test -count=1 -trimpath $pkgs
}

if [ "$mode" = seam ]; then
	# kcp's own tests of the seam compile test variants of kcp's packages,
	# and the newest release's fetch and compile its Kubernetes 1.36 fork:
	# some twenty minutes on a machine that has not. They run when their
	# inputs changed.
	sum=$(cat "$patch" "$repo/docs/kcp/webhook-tunnel-$newest.patch" "$here/build.sh" | sha256sum | cut -c1-64)
	if [ "${2:-}" != force ] && [ "$(cat "$here/seam.sum" 2>/dev/null)" = "$sum" ]; then
		echo "kcp's tests of the seam passed with these patches and this build.sh (deploy/kcp/seam.sum)" >&2
		exit 0
	fi
	build=$(mktemp -d "${TMPDIR:-/tmp}/kcp-seam.XXXXXX")
	newest_build=$(mktemp -d "${TMPDIR:-/tmp}/kcp-newest.XXXXXX")
	trap 'rm -rf "$build" "$newest_build"' EXIT
	prepare
	(
		cd "$build"
		# kcp's tests need modules its binary does not (testify):
		# -mod=mod records them in the copy's go.sum.
		echo "kcp $kcp with docs/kcp/webhook-tunnel.patch: kcp's tests of the packages the patch touches" >&2
		GOFLAGS="$GOFLAGS -mod=mod" go test -count=1 -trimpath \
			github.com/kcp-dev/kcp/pkg/admission/initializers \
			github.com/kcp-dev/kcp/pkg/admission/validatingwebhook \
			github.com/kcp-dev/kcp/pkg/admission/mutatingwebhook \
			github.com/kcp-dev/kcp/pkg/server
	)
	build=$newest_build newest_seam
	echo "$sum" >"$here/seam.sum"
	echo "kcp's tests of the seam passed: commit deploy/kcp/seam.sum" >&2
	exit 0
fi

if [ -x "$dir/kcp" ]; then
	echo "$dir/kcp"
	exit 0
fi
mkdir -p "$cache"
# Tests of several packages may ask at once: one builds, the others wait.
exec 9>"$dir.lock"
flock 9
if [ ! -x "$dir/kcp" ]; then
	build=$repo/.cache/kcp-build/$kcp-$key
	trap 'rm -rf "$build"' EXIT
	prepare
	(
		cd "$build"
		# kcp reports its version as kcp's release does (kubectl and
		# client-go parse it); the Kubernetes version is its fork's base.
		pkg=k8s.io/component-base/version
		ldflags="-s -w -X $pkg.gitVersion=v1.32.3+kcp-$kcp -X $pkg.gitMajor=1 -X $pkg.gitMinor=32 -X $pkg.gitTreeState=clean"
		echo "building kcp $kcp with docs/kcp/webhook-tunnel.patch and deploy/kcp into $dir (the first build takes many minutes)" >&2
		go build -trimpath -ldflags "$ldflags" -o "$build/kcp.bin" .
	)
	mkdir -p "$dir"
	mv "$build/kcp.bin" "$dir/kcp"
	# Builds for an older patch or kcpplugin are not wanted again.
	for old in "$cache"/kcp-*; do
		case $old in "$dir" | "$dir.lock") ;; *) rm -rf "$old" ;; esac
	done
fi
echo "$dir/kcp"
