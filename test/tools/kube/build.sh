#!/bin/sh
# Builds kube-apiserver, kubectl and etcd at the versions pinned in this
# folder's go.mod, unless a build of those versions is already cached, and
# prints the folder that holds them. The cache lives in the repo's
# git-ignored .cache/kube/ (or $KUBE_TOOLS_CACHE), one folder per version pair
# and go.sum, so a second run only checks that the binaries are there, and
# builds only those missing (a cache from before kubectl was added gets
# kubectl alone).
# make kube-tools, the KubeAPIServer tests and the Deploy tests call this.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
cache=${KUBE_TOOLS_CACHE:-$(cd "$here/../../.." && pwd)/.cache/kube}
cd "$here"
# This module is deliberately outside the repo's go.work.
export GOWORK=off

kube=$(go list -m -f '{{.Version}}' k8s.io/kubernetes)
etcd=$(go list -m -f '{{.Version}}' go.etcd.io/etcd/server/v3)
# go.sum's digest: a change of any dependency builds anew.
dir=$cache/kubernetes-$kube-etcd-$etcd-$(sha256sum go.sum | cut -c1-12)
binaries="kube-apiserver kubectl etcd"
missing() {
	for b in $binaries; do
		[ -x "$dir/$b" ] || echo "$b"
	done
}
if [ -z "$(missing)" ]; then
	echo "$dir"
	exit 0
fi

mkdir -p "$cache"
# Tests of several packages may ask at once: one builds, the others wait.
exec 9>"$dir.lock"
flock 9
todo=$(missing)
if [ -n "$todo" ]; then
	tmp=$(mktemp -d "$cache/.build-XXXXXX")
	trap 'rm -rf "$tmp"' EXIT
	minor=$(echo "$kube" | cut -d. -f2)
	# kubectl and client-go parse the server's version: give it the real one.
	pkg=k8s.io/component-base/version
	ldflags="-s -w -X $pkg.gitVersion=$kube -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
	echo "building" $todo "(kubernetes $kube, etcd $etcd) into $dir (the first build takes many minutes)" >&2
	for b in $todo; do
		case $b in
		etcd) go build -ldflags "-s -w" -o "$tmp/etcd" go.etcd.io/etcd/server/v3 ;;
		*) go build -ldflags "$ldflags" -o "$tmp/$b" "k8s.io/kubernetes/cmd/$b" ;;
		esac
	done
	mkdir -p "$dir"
	for b in $todo; do
		mv "$tmp/$b" "$dir/"
	done
fi
echo "$dir"
