package caddyktls

import (
	"encoding/json"
	"errors"
	"io"
	"os/exec"
	"slices"
	"strings"
	"testing"
)

// layers is who may import whom among this module's packages, lowest layer
// first: each package, whether it may depend on Caddy (or caddy-l4), and
// the packages of this module it may import. Arrows only point down: a
// mechanism never reaches the Caddy glue, a feature never reaches another
// feature or the root, and the shared glue never reaches a feature. A new
// package, or a new arrow, is added here first.
var layers = []layer{
	// Mechanisms: no Caddy.
	{"internal/sockerr", false, nil},
	{"internal/loopback", false, nil},
	{"internal/cphttp", false, nil},
	{"internal/fdpass", false, nil},
	{"internal/tcpfile", false, nil},
	{"internal/wire", false, nil},
	{"internal/handoff", false, []string{"internal/fdpass"}},
	{"ktls", false, []string{"internal/loopback", "internal/tcpfile", "internal/wire"}},
	{"splice", false, []string{"internal/sockerr", "internal/wire"}},
	{"preamble", false, nil},
	{"forward", false, []string{"preamble", "splice", "internal/cphttp", "internal/handoff", "internal/tcpfile", "internal/wire"}},
	{"gateway", false, []string{"ktls", "preamble", "splice", "internal/cphttp", "internal/handoff", "internal/wire"}},

	// Test support: imported by tests only, never by a product package.
	{"internal/testpki", false, nil},
	{"internal/cputest", false, nil},
	{"internal/freeport", false, nil},
	{"internal/splicetest", false, nil},
	{"internal/kerneltest", false, []string{"internal/loopback"}},
	{"forward/forwardtest", false, []string{"preamble", "splice", "internal/sockerr", "internal/kerneltest"}},

	// The Caddy glue that the features share.
	{"internal/moduleid", false, nil},
	{"internal/logsummary", false, nil},
	{"internal/caddyfileargs", true, nil},
	{"internal/adminapi", true, nil},
	{"internal/controlplane", true, nil},
	{"internal/l4conn", true, []string{"splice"}},
	{"internal/caddymetrics", true, []string{"internal/moduleid"}},
	{"internal/listensock", true, []string{"ktls", "internal/moduleid", "internal/caddymetrics"}},
	{"internal/upgrade", true, []string{"internal/handoff", "internal/listensock", "internal/moduleid"}},
	{"internal/offload", true, []string{"ktls", "gateway", "internal/moduleid", "internal/caddymetrics", "internal/logsummary", "internal/caddyfileargs"}},

	// The features.
	{"modules/forwarder", true, []string{"ktls", "splice", "preamble", "forward",
		"internal/moduleid", "internal/caddymetrics", "internal/logsummary", "internal/caddyfileargs", "internal/adminapi", "internal/controlplane", "internal/l4conn", "internal/offload", "internal/handoff", "internal/listensock", "internal/upgrade"}},
	{"modules/edgegateway", true, []string{"ktls", "splice", "preamble", "gateway",
		"internal/moduleid", "internal/caddymetrics", "internal/caddyfileargs", "internal/controlplane", "internal/l4conn", "internal/offload", "internal/handoff", "internal/upgrade"}},
	{"modules/handoff", true, []string{"internal/moduleid", "internal/caddymetrics", "internal/caddyfileargs", "internal/adminapi", "internal/controlplane", "internal/handoff", "internal/listensock", "internal/upgrade"}},
	{"internal/cli", true, []string{"ktls", "preamble", "gateway", "internal/offload"}},

	// The root: the map, and the TLS offload modules.
	{"", true, []string{"ktls", "internal/moduleid", "internal/caddymetrics", "internal/caddyfileargs", "internal/offload", "internal/listensock",
		"modules/forwarder", "modules/edgegateway", "modules/handoff", "internal/cli"}},
	{"cmd/caddy", true, []string{""}},

	// Tools and examples beside the product.
	{"integration/internal/benchjson", false, nil}, // the load and time-to-first-byte runs' JSON, which bench writes and benchreport renders
	{"integration/bench", false, []string{"ktls", "splice", "preamble", "gateway", "internal/kerneltest", "internal/freeport", "integration/internal/benchjson"}},
	{"integration/benchreport", false, []string{"integration/internal/benchjson"}},
	{"deploy", false, nil},
	{"examples/demo-upstream", false, nil},
}

type layer struct {
	pkg   string
	caddy bool // may depend on Caddy
	may   []string
}

// layerOf returns the index of pkg in layers, -1 for none.
func layerOf(pkg string) int {
	return slices.IndexFunc(layers, func(l layer) bool { return l.pkg == pkg })
}

const modulePath = "github.com/ktlsingress/caddy-ktls"

// TestImportLayers checks every package's imports (tests' own imports
// aside) against layers: an import of this module that the table does not
// allow, a package the table does not know, or Caddy under a package that
// must not depend on it fails.
func TestImportLayers(t *testing.T) {
	out, err := exec.Command("go", "list", "-json=ImportPath,Imports,Deps", "./...").Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			t.Fatalf("go list: %v\n%s", err, ee.Stderr)
		}
		t.Fatalf("go list: %v", err)
	}
	type pkg struct {
		ImportPath    string
		Imports, Deps []string
	}
	short := func(p string) (string, bool) {
		if p == modulePath {
			return "", true
		}
		s, ok := strings.CutPrefix(p, modulePath+"/")
		return s, ok
	}
	seen := map[string]bool{}
	dec := json.NewDecoder(strings.NewReader(string(out)))
	for {
		var p pkg
		if err := dec.Decode(&p); err == io.EOF {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		name, _ := short(p.ImportPath)
		seen[name] = true
		i := layerOf(name)
		if i < 0 {
			t.Errorf("package %q is not in layers (layers_test.go): say what it may import", name)
			continue
		}
		l := layers[i]
		for _, imp := range p.Imports {
			s, ours := short(imp)
			if !ours {
				continue
			}
			if !slices.Contains(l.may, s) {
				t.Errorf("%q imports %q: not an arrow layers allows (up or sideways)", name, s)
			}
			if layerOf(s) > i {
				t.Errorf("%q imports %q, which layers lists above it", name, s)
			}
		}
		if !l.caddy {
			for _, d := range p.Deps {
				if strings.HasPrefix(d, "github.com/caddyserver/") || strings.HasPrefix(d, "github.com/mholt/caddy-l4") {
					t.Errorf("%q depends on %s: it must not depend on Caddy", name, d)
					break
				}
			}
		}
	}
	for _, l := range layers {
		if !seen[l.pkg] {
			t.Errorf("layers lists %q, which go list does not know", l.pkg)
		}
	}
}
