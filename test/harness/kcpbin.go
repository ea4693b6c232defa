package harness

var kcpTool = cachedTool{name: "kcp"}

// KCPBinary returns the path of a kcp binary built by test/tools/kcp/build.sh:
// kcp at the version pinned there, with docs/kcp/webhook-tunnel.patch
// applied and kcpplugin linked in. The build is cached in the repo's
// .cache/kcp/, so only the first call on a machine (or after the patch or
// kcpplugin changed) builds, for many minutes; later ones find it at once.
func KCPBinary() (string, error) { return kcpTool.get() }
