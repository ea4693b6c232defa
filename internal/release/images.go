package release

// Image is one image make images builds (internal/release/cmd/images).
type Image struct {
	// Binary is the binary the image runs, bin/<Binary> before it is
	// packed; its OCI archive is bin/images/<Binary>.tar.
	Binary string
	// Name is the image's full name, without its tag: the name written in
	// the archives and the one deploy/ runs.
	Name string
	// Title is the image's org.opencontainers.image.title label.
	Title string
}

// LocalPrefix begins the images' names. A name without a registry host is
// read as one on the default registry, where nothing of this repository is
// published: a cluster that loaded an archive would look for, and try to
// pull, a name it does not have. localhost/ is the host of images built and
// loaded locally, which no one pulls; a cluster that pulls from a registry
// is given the images pushed there by name (image.repository, newName).
const LocalPrefix = "localhost/"

// The images make images builds.
var (
	Broker      = Image{"broker", LocalPrefix + "kcp-dev/tunnel-broker", "kcp tunnel broker"}
	SyncerAgent = Image{"syncer-agent", LocalPrefix + "kcp-dev/tunnel-syncer-agent", "kcp tunnel syncer-agent"}
	Kcp         = Image{"kcp", LocalPrefix + "kcp-dev/tunnel-kcp", "kcp with the tunnel broker's webhook seam"}
	// Tunnelctl is the operators' CLI, which the broker chart's helm test
	// runs.
	Tunnelctl = Image{"tunnelctl", LocalPrefix + "kcp-dev/tunnelctl", "kcp tunnel broker's tunnelctl"}
)

// Built are the images make images builds.
var Built = []Image{Broker, SyncerAgent, Kcp, Tunnelctl}

// Images are the names of the images deploy/'s overlays and charts run, as
// they refer to them. kcp's image is not one: kcp-dev's kcp chart runs it,
// with deploy/kcp's values (KcpChartValues); nor is tunnelctl's, which
// only the broker chart's helm test runs (tests.image).
var Images = []string{Broker.Name, SyncerAgent.Name}
