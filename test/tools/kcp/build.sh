#!/bin/sh
# Builds kcp at the version pinned in this folder's go.mod, with
# docs/kcp/webhook-tunnel.patch applied and kcp_tunnel.go added to its
# cmd/kcp, unless that build is already cached, and prints the path of the
# binary. The cache lives in the repo's git-ignored .cache/ (or
# $KCP_TOOLS_CACHE), one folder per key: the kcp version and a hash of the
# patch, kcp_tunnel.go, this module's go.mod and go.sum and the sources of
# kcpplugin and proto that kcp links in. make kcp-tools and the RealKCP tests
# call this.
#
# How: kcp's module source comes from the module cache (the Go module proxy),
# is copied into .cache/kcp-build/src-<key>/, patched, and built from a module
# made there of this folder's go.mod (kcp's replace directives: k8s.io/* from
# kcp's fork of Kubernetes) with github.com/kcp-dev/kcp replaced by the
# patched copy and kcpplugin and proto by this repository's folders.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
cache=${KCP_TOOLS_CACHE:-$repo/.cache/kcp}
patch=$repo/docs/kcp/webhook-tunnel.patch
cd "$here"
# This module is deliberately outside the repo's go.work.
export GOWORK=off

kcp=$(go list -m -f '{{.Version}}' github.com/kcp-dev/kcp)
key=$(
	cd "$repo"
	{
		cat "$patch" "$here/kcp_tunnel.go" "$here/go.mod" "$here/go.sum"
		find kcpplugin proto -type f \( -name '*.go' ! -name '*_test.go' -o -name go.mod \) | LC_ALL=C sort | xargs cat
	} | sha256sum | cut -c1-12
)
dir=$cache/kcp-$kcp-$key
if [ -x "$dir/kcp" ]; then
	echo "$dir/kcp"
	exit 0
fi

mkdir -p "$cache"
# Tests of several packages may ask at once: one builds, the others wait.
exec 9>"$dir.lock"
flock 9
if [ ! -x "$dir/kcp" ]; then
	src=$(go mod download -json "github.com/kcp-dev/kcp@$kcp" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
	[ -d "$src" ] || { echo "kcp $kcp: no module source in the module cache" >&2; exit 1; }
	build=$repo/.cache/kcp-build/$kcp-$key
	rm -rf "$build"
	mkdir -p "$build"
	trap 'rm -rf "$build"' EXIT
	cp -R "$src" "$build/kcp"
	chmod -R u+w "$build/kcp"
	# git apply, in a repository of the copy's own (patch(1) may be
	# missing; the copy lies inside this repository's work tree).
	(cd "$build/kcp" && git init -q && git apply "$patch" && rm -rf .git)
	sed 's/^\/\/go:build kcptunnel$//' "$here/kcp_tunnel.go" >"$build/kcp/cmd/kcp/zz_kcp_tunnel.go"

	# The build module: this folder's, with kcp from the patched copy and
	# kcpplugin and proto from this repository (absolute paths).
	cp "$here/go.mod" "$here/go.sum" "$build/"
	(
		cd "$build"
		go mod edit -module kcp-build \
			-replace "github.com/kcp-dev/kcp=./kcp" \
			-replace "github.com/kcp-dev/tunnel-broker/kcpplugin=$repo/kcpplugin" \
			-replace "github.com/kcp-dev/tunnel-broker/proto=$repo/proto"
		# kcp reports its version as kcp's release does (kubectl and
		# client-go parse it); the Kubernetes version is its fork's base.
		pkg=k8s.io/component-base/version
		ldflags="-s -w -X $pkg.gitVersion=v1.31.0+kcp-$kcp -X $pkg.gitMajor=1 -X $pkg.gitMinor=31 -X $pkg.gitTreeState=clean"
		echo "building kcp $kcp with docs/kcp/webhook-tunnel.patch into $dir (the first build takes many minutes)" >&2
		go build -buildvcs=false -ldflags "$ldflags" -o "$build/kcp.bin" github.com/kcp-dev/kcp/cmd/kcp
	)
	mkdir -p "$dir"
	mv "$build/kcp.bin" "$dir/kcp"
	# Builds for an older patch or kcpplugin are not wanted again.
	for old in "$cache"/kcp-*; do
		case $old in "$dir" | "$dir.lock") ;; *) rm -rf "$old" ;; esac
	done
fi
echo "$dir/kcp"
