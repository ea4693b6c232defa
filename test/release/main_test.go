// Package release checks a release the way its users meet it: this
// repository's modules served at a version by a module proxy, and a module
// outside the repository, shaped like kcp's, that requires kcpplugin with go
// get and calls a webhook through the tunnel with it.
package release

import (
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
