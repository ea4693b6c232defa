package deploy

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// TestDeployDockerfiles reads deploy/docker/<binary>.Dockerfile for each
// binary (no image can be built here: there is no container engine) and
// checks what the images promise: a Go builder stage that builds the
// binary's package statically (CGO_ENABLED=0) with -trimpath, and a final
// stage from scratch or a distroless static image that holds only that
// binary and runs it as a non-root user.
func TestDeployDockerfiles(t *testing.T) {
	for binary, pkg := range map[string]string{
		"broker":       "./broker",
		"syncer-agent": "./syncer-agent",
		"tunnelctl":    "./broker/cmd/tunnelctl",
	} {
		t.Run(binary, func(t *testing.T) { checkDockerfile(t, binary, pkg) })
	}
	checkDockerignore(t)
}

// checkDockerfile checks deploy/docker/<binary>.Dockerfile, which builds
// package pkg: its first stage is the builder, its last the final image.
func checkDockerfile(t *testing.T, binary, pkg string) {
	if _, err := os.Stat(filepath.Join(repoRoot(), pkg, "main.go")); err != nil {
		t.Fatalf("the binary's package: %v", err)
	}
	stages, args := parseDockerfile(t, filepath.Join(deployDir(), "docker", binary+".Dockerfile"))
	if len(stages) < 2 {
		t.Fatalf("%d stage(s): want a builder and a final stage", len(stages))
	}
	builderFrom, out := checkBuilderStage(t, stages[0], pkg)
	checkFinalStage(t, stages[len(stages)-1], args, binary, builderFrom, out)
}

// checkBuilderStage checks that build is a Go builder stage that builds pkg
// statically with -trimpath, and returns the words of its FROM (the last
// is the stage's name) and the binary's path in it.
func checkBuilderStage(t *testing.T, build stage, pkg string) (from []string, out string) {
	t.Helper()
	from = slices.DeleteFunc(strings.Fields(build.from), func(f string) bool { return strings.HasPrefix(f, "--") })
	if len(from) != 3 || !strings.HasPrefix(from[0], "golang:") || !strings.EqualFold(from[1], "AS") {
		t.Errorf("builder stage: FROM %s, want FROM golang:<version> AS <name>", build.from)
	}
	if !build.has("ENV", "CGO_ENABLED=0") && !build.has("RUN", "CGO_ENABLED=0") {
		t.Error("builder stage: no CGO_ENABLED=0, so the binary may need a libc the final image lacks")
	}
	goBuild := regexp.MustCompile(`go build .*-trimpath.* -o (\S+) ` + regexp.QuoteMeta(pkg) + `(\s|$)`)
	for _, run := range build.all("RUN") {
		if m := goBuild.FindStringSubmatch(run); m != nil {
			out = m[1]
		}
	}
	if out == "" {
		t.Fatalf("builder stage: no RUN go build -trimpath -o OUT %s", pkg)
	}
	return from, out
}

// checkFinalStage checks that final is from scratch or a distroless static
// image (args resolves a FROM ${ARG}), holds the binary out of the builder
// stage (builderFrom, the words of its FROM), and runs it as a non-root
// user.
func checkFinalStage(t *testing.T, final stage, args map[string]string, binary string, builderFrom []string, out string) {
	t.Helper()
	base := final.from
	if strings.HasPrefix(base, "${") {
		base = args[strings.Trim(base, "${}")]
	}
	if base != "scratch" && !strings.Contains(base, "distroless/static") {
		t.Errorf("final stage: FROM %s (%s), want scratch or a distroless static image", final.from, base)
	}
	if !final.has("COPY", "--from="+builderFrom[len(builderFrom)-1]+" "+out+" ") {
		t.Errorf("final stage: the binary %s is not copied from the builder stage", out)
	}
	user := final.all("USER")
	if len(user) == 0 {
		t.Fatal("final stage: no USER")
	}
	name, _, _ := strings.Cut(user[len(user)-1], ":")
	if name == "0" || name == "root" || name == "" {
		t.Errorf("final stage: USER %s", user[len(user)-1])
	}
	entry := final.all("ENTRYPOINT")
	if len(entry) == 0 || !strings.Contains(entry[len(entry)-1], "/"+binary) {
		t.Errorf("final stage: ENTRYPOINT %v does not run /%s", entry, binary)
	}
}

// checkDockerignore checks that the build context leaves out what is
// built or cached locally (the kube-apiserver builds in .cache/ alone are
// hundreds of megabytes).
func checkDockerignore(t *testing.T) {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(repoRoot(), ".dockerignore"))
	if err != nil {
		t.Fatal(err)
	}
	ignored := strings.Fields(string(raw))
	for _, want := range []string{".git", ".cache", "bin"} {
		if !slices.Contains(ignored, want) {
			t.Errorf(".dockerignore does not leave out %s", want)
		}
	}
}

// stage is one FROM of a Dockerfile and its instructions.
type stage struct {
	from  string
	instr [][2]string // instruction (upper case), arguments
}

func (s stage) all(instr string) []string {
	var out []string
	for _, i := range s.instr {
		if i[0] == instr {
			out = append(out, i[1])
		}
	}
	return out
}

func (s stage) has(instr, substr string) bool {
	return slices.ContainsFunc(s.all(instr), func(a string) bool { return strings.Contains(a+" ", substr) })
}

// parseDockerfile splits a Dockerfile into its stages, joining continued
// lines and dropping comments; args are the ARGs before the first FROM with
// their defaults.
func parseDockerfile(t *testing.T, path string) (stages []stage, args map[string]string) {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	args = map[string]string{}
	var line string
	for _, l := range strings.Split(string(raw), "\n") {
		trimmed := strings.TrimSpace(l)
		if strings.HasPrefix(trimmed, "#") {
			continue
		}
		if cont, ok := strings.CutSuffix(trimmed, "\\"); ok {
			line += cont + " "
			continue
		}
		line += trimmed
		if line == "" {
			continue
		}
		instr, rest, _ := strings.Cut(line, " ")
		instr, rest = strings.ToUpper(instr), strings.Join(strings.Fields(rest), " ")
		line = ""
		switch {
		case instr == "FROM":
			stages = append(stages, stage{from: rest})
		case len(stages) == 0 && instr == "ARG":
			name, value, _ := strings.Cut(rest, "=")
			args[name] = value
		case len(stages) == 0:
			t.Fatalf("%s: %s before the first FROM", path, instr)
		default:
			s := &stages[len(stages)-1]
			s.instr = append(s.instr, [2]string{instr, rest})
		}
	}
	return stages, args
}
