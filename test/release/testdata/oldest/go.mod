// kcp-shaped: a module of its own on the oldest Kubernetes libraries and
// gRPC that kcpplugin supports. The release check adds kcpplugin with go get.
module example.com/kcp

go 1.23.0

require (
	google.golang.org/grpc v1.69.2
	google.golang.org/protobuf v1.36.2 // indirect
	k8s.io/api v0.31.0
	k8s.io/apimachinery v0.31.0
	k8s.io/apiserver v0.31.0
	k8s.io/client-go v0.31.0
)
