package release

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/mod/module"
	"golang.org/x/mod/zip"
)

// WriteProxy lays out dir as a Go module proxy (GOPROXY=file://dir) that
// serves each of Modules at version, built from the files of the work tree
// at repo that git tracks or would track (so a new file counts before it is
// committed), with go.mod stamped by StampGoMod: what tagging the tree at
// version would publish.
func WriteProxy(repo, dir, version string) error {
	if err := CheckVersion(version); err != nil {
		return err
	}
	for _, m := range Modules {
		if err := writeModule(repo, dir, m, version); err != nil {
			return fmt.Errorf("%s@%s: %w", m.Path, version, err)
		}
	}
	return nil
}

func writeModule(repo, dir string, m Module, version string) error {
	src := filepath.Join(repo, m.Dir)
	goMod, err := os.ReadFile(filepath.Join(src, "go.mod"))
	if err != nil {
		return err
	}
	stamped, err := StampGoMod(filepath.Join(src, "go.mod"), goMod, version)
	if err != nil {
		return err
	}
	files, err := workTreeFiles(src)
	if err != nil {
		return err
	}
	for i, f := range files {
		if f.Path() == "go.mod" {
			files[i] = memFile{path: "go.mod", data: stamped}
		}
	}

	escaped, err := module.EscapePath(m.Path)
	if err != nil {
		return err
	}
	at := filepath.Join(dir, filepath.FromSlash(escaped), "@v")
	if err := os.MkdirAll(at, 0o755); err != nil {
		return err
	}
	var z bytes.Buffer
	if err := zip.Create(&z, module.Version{Path: m.Path, Version: version}, files); err != nil {
		return err
	}
	info, err := json.Marshal(struct {
		Version string
		Time    time.Time
	}{version, time.Now().UTC().Truncate(time.Second)})
	if err != nil {
		return err
	}
	for name, data := range map[string][]byte{
		version + ".zip":  z.Bytes(),
		version + ".mod":  stamped,
		version + ".info": info,
		"list":            []byte(version + "\n"),
	} {
		if err := os.WriteFile(filepath.Join(at, name), data, 0o644); err != nil {
			return err
		}
	}
	return nil
}

// workTreeFiles are the files under dir that git tracks or would track,
// as they are in the work tree; zip.Create leaves out nested modules.
func workTreeFiles(dir string) ([]zip.File, error) {
	out, err := exec.Command("git", "-C", dir, "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", ".").Output()
	if err != nil {
		return nil, fmt.Errorf("git ls-files in %s: %w", dir, err)
	}
	var files []zip.File
	for _, name := range strings.Split(string(out), "\x00") {
		if name == "" {
			continue
		}
		p := filepath.Join(dir, filepath.FromSlash(name))
		info, err := os.Lstat(p)
		if os.IsNotExist(err) {
			continue // deleted in the work tree, not yet in the index
		}
		if err != nil {
			return nil, err
		}
		files = append(files, diskFile{path: name, file: p, info: info})
	}
	return files, nil
}

type diskFile struct {
	path, file string
	info       fs.FileInfo
}

func (f diskFile) Path() string                 { return f.path }
func (f diskFile) Lstat() (fs.FileInfo, error)  { return f.info, nil }
func (f diskFile) Open() (io.ReadCloser, error) { return os.Open(f.file) }

type memFile struct {
	path string
	data []byte
}

func (f memFile) Path() string                 { return f.path }
func (f memFile) Lstat() (fs.FileInfo, error)  { return memInfo{f}, nil }
func (f memFile) Open() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(f.data)), nil }

type memInfo struct{ f memFile }

func (i memInfo) Name() string       { return filepath.Base(i.f.path) }
func (i memInfo) Size() int64        { return int64(len(i.f.data)) }
func (i memInfo) Mode() fs.FileMode  { return 0o644 }
func (i memInfo) ModTime() time.Time { return time.Time{} }
func (i memInfo) IsDir() bool        { return false }
func (i memInfo) Sys() any           { return nil }
