package lookup

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// A bad services file is refused with the path of the bad field.
func TestStaticFileErrorsNameTheField(t *testing.T) {
	for _, tc := range []struct{ name, file, want string }{
		{"port 0", "services:\n- {cluster: root, namespace: default, name: web, ports: {\"0\": 127.0.0.1:80}}\n", "services[0].ports: port 0 is outside 1-65535"},
		{"port too large", "services:\n- {cluster: root, namespace: default, name: web, ports: {\"70000\": 127.0.0.1:80}}\n", "services[0].ports: port 70000 is outside 1-65535"},
		{"address port too large", "services:\n- {cluster: root, namespace: default, name: web, ports: {\"80\": \"127.0.0.1:99999\"}}\n", "services[0].ports.80: address 127.0.0.1:99999: port 99999 is outside 1-65535"},
		{"unknown field", "services:\n- {cluster: root, namespace: default, service: web, ports: {\"80\": 127.0.0.1:80}}\n", `services[0]: unknown field "service"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "services.yaml")
			if err := os.WriteFile(path, []byte(tc.file), 0o600); err != nil {
				t.Fatal(err)
			}
			_, err := LoadStatic(path)
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), path) {
				t.Fatalf("got %v, want an error naming %s and %q", err, path, tc.want)
			}
		})
	}
}
