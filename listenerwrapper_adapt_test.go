package caddyktls

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig"
	_ "github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
)

var updateGolden = flag.Bool("update-listener-golden", false, "rewrite the expected JSON of testdata/caddyfile_adapt/listener_*.caddytest")

// adaptCaddyfile runs the Caddyfile adapter in-process, as `caddy adapt` does.
func adaptCaddyfile(t *testing.T, caddyfile string) ([]byte, error) {
	t.Helper()
	out, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfile), map[string]any{"filename": "Caddyfile"})
	return out, err
}

// TestListenerWrapperCaddyfileAdapt checks every
// testdata/caddyfile_adapt/listener_*.caddytest: a Caddyfile, a line of
// dashes, and the JSON `caddy adapt` must produce.
func TestListenerWrapperCaddyfileAdapt(t *testing.T) {
	checkAdaptGolden(t, "testdata/caddyfile_adapt/listener_*.caddytest", *updateGolden)
}

// checkAdaptGolden checks every golden file matching pattern: a Caddyfile, a
// line of dashes, and the JSON `caddy adapt` must produce. With update it
// rewrites the expected JSON instead.
func checkAdaptGolden(t *testing.T, pattern string, update bool) {
	t.Helper()
	files, err := filepath.Glob(pattern)
	if err != nil || len(files) == 0 {
		t.Fatalf("no golden files: %v", err)
	}
	for _, file := range files {
		t.Run(filepath.Base(file), func(t *testing.T) {
			raw, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			caddyfile, wantJSON, ok := strings.Cut(string(raw), "\n----------\n")
			if !ok {
				t.Fatalf("%s: no ---------- separator line", file)
			}
			got, err := adaptCaddyfile(t, caddyfile)
			if err != nil {
				t.Fatalf("adapt: %v", err)
			}
			var gotBuf, wantBuf bytes.Buffer
			if err := json.Indent(&gotBuf, got, "", "\t"); err != nil {
				t.Fatal(err)
			}
			if update {
				if err := os.WriteFile(file, []byte(caddyfile+"\n----------\n"+gotBuf.String()+"\n"), 0o644); err != nil {
					t.Fatal(err)
				}
				return
			}
			if err := json.Indent(&wantBuf, []byte(strings.TrimSpace(wantJSON)), "", "\t"); err != nil {
				t.Fatalf("expected JSON in %s: %v", file, err)
			}
			if gotBuf.String() != wantBuf.String() {
				t.Errorf("adapted JSON differs from %s.\ngot:\n%s\nwant:\n%s", file, gotBuf.String(), wantBuf.String())
			}
		})
	}
}

// TestListenerWrapperCaddyfileErrors: bad options fail adaptation with a
// message naming the problem.
func TestListenerWrapperCaddyfileErrors(t *testing.T) {
	for name, tc := range map[string]struct{ block, want string }{
		"unknown option":       {"bogus", `unknown ktls listener wrapper option "bogus"`},
		"rx value":             {"rx maybe", "rx takes one of on, off"},
		"rx missing":           {"rx", "rx takes one of on, off"},
		"offload value":        {"offload maybe", "offload takes one of on, off"},
		"fallback value":       {"fallback sometimes", "fallback takes one of allow, refuse"},
		"flag with argument":   {"expect_no_pad yes", "expect_no_pad takes no arguments"},
		"rate not a number":    {"keyupdate_rate fast", `keyupdate_rate: "fast" is not a positive number`},
		"rate zero":            {"keyupdate_rate 0", `keyupdate_rate: "0" is not a positive number`},
		"burst not an integer": {"keyupdate_rate 5 1.5", `burst "1.5" is not a positive integer`},
		"rate arity":           {"keyupdate_rate 1 2 3", "keyupdate_rate takes a rate per second and an optional burst"},
		"timeout":              {"handshake_timeout soon", `handshake_timeout: "soon" is not a positive duration`},
	} {
		t.Run(name, func(t *testing.T) {
			caddyfile := "{\n\tservers {\n\t\tlistener_wrappers {\n\t\t\tktls {\n\t\t\t\t" + tc.block + "\n\t\t\t}\n\t\t}\n\t}\n}\n\nexample.com {\n\trespond ok\n}\n"
			_, err := adaptCaddyfile(t, caddyfile)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

// TestListenerWrapperExamplesAdapt keeps the examples/http-*.Caddyfile
// examples valid.
func TestListenerWrapperExamplesAdapt(t *testing.T) {
	files, err := filepath.Glob("examples/http-*.Caddyfile")
	if err != nil || len(files) == 0 {
		t.Fatalf("no examples: %v", err)
	}
	for _, file := range files {
		raw, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		out, err := adaptCaddyfile(t, string(raw))
		if err != nil {
			t.Errorf("%s: %v", file, err)
			continue
		}
		if !bytes.Contains(out, []byte(`"wrapper":"ktls"`)) {
			t.Errorf("%s: adapted config has no ktls listener wrapper: %s", file, out)
		}
	}
}
