// Package yamlfile reads the binaries' YAML (or JSON) configuration files
// strictly, and says what is wrong where: the path of the bad field
// (agents[0]: unknown field "cluster"), in YAML's words, not in the words of
// the JSON decoder sigs.k8s.io/yaml converts to.
package yamlfile

import (
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"

	"sigs.k8s.io/yaml"
)

// Unmarshal decodes raw into out (a pointer to a struct with json tags),
// refusing fields out does not have, each named by its path.
func Unmarshal(raw []byte, out any) error {
	var doc any
	if err := yaml.Unmarshal(raw, &doc); err != nil {
		return reword(err)
	}
	if err := knownFields(doc, reflect.TypeOf(out).Elem(), ""); err != nil {
		return err
	}
	if err := yaml.UnmarshalStrict(raw, out); err != nil {
		return reword(err)
	}
	return nil
}

// knownFields walks doc along t and names the first field t does not have.
func knownFields(doc any, t reflect.Type, path string) error {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch v := doc.(type) {
	case map[string]any:
		return knownMapFields(v, t, path)
	case []any:
		if t.Kind() != reflect.Slice {
			return nil // a type error, which the decoder names
		}
		for i, item := range v {
			if err := knownFields(item, t.Elem(), fmt.Sprintf("%s[%d]", path, i)); err != nil {
				return err
			}
		}
	}
	return nil
}

func knownMapFields(m map[string]any, t reflect.Type, path string) error {
	if t.Kind() == reflect.Map {
		for _, k := range slices.Sorted(maps.Keys(m)) {
			if err := knownFields(m[k], t.Elem(), join(path, k)); err != nil {
				return err
			}
		}
		return nil
	}
	if t.Kind() != reflect.Struct {
		return nil
	}
	fields := map[string]reflect.Type{}
	for i := range t.NumField() {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name != "" && name != "-" {
			fields[name] = f.Type
		}
	}
	for _, k := range slices.Sorted(maps.Keys(m)) {
		ft, ok := fields[k]
		if !ok {
			where := path
			if where == "" {
				where = "top level"
			}
			return fmt.Errorf("%s: unknown field %q (known: %s)", where, k, strings.Join(slices.Sorted(maps.Keys(fields)), ", "))
		}
		if err := knownFields(m[k], ft, join(path, k)); err != nil {
			return err
		}
	}
	return nil
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

// reword turns sigs.k8s.io/yaml's errors, which speak of JSON, into YAML's.
func reword(err error) error {
	msg := err.Error()
	for _, prefix := range []string{"error converting YAML to JSON: ", "error unmarshaling JSON: ", "while decoding JSON: ", "json: "} {
		msg = strings.TrimPrefix(msg, prefix)
	}
	msg = strings.ReplaceAll(msg, "Go struct field ", "field ")
	return fmt.Errorf("YAML: %s", msg)
}
