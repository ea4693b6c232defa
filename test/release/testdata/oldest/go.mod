// kcp-shaped: a module of its own on the oldest Kubernetes libraries and
// gRPC that kcpplugin supports. The release check adds kcpplugin with go get.
module example.com/kcp

go 1.25.0

require (
	google.golang.org/grpc v1.72.2
	k8s.io/api v0.31.0
	k8s.io/apimachinery v0.31.0
	k8s.io/apiserver v0.31.0
	k8s.io/client-go v0.31.0
)
