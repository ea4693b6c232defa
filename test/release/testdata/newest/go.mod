// kcp-shaped, on the newest Kubernetes libraries and gRPC that kcpplugin is
// tested with. The release check adds kcpplugin with go get.
module example.com/kcp

go 1.26.0

require (
	google.golang.org/grpc v1.85.0
	k8s.io/api v0.37.2
	k8s.io/apimachinery v0.37.2
	k8s.io/apiserver v0.37.2
	k8s.io/client-go v0.37.2
)
