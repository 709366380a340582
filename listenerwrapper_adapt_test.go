package caddyktls

import (
	"bytes"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	_ "github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
)

var updateGolden = flag.Bool("update-listener-golden", false, "rewrite the expected JSON of testdata/caddyfile_adapt/listener_*.caddytest and example_http_forwarder.json")

// TestListenerWrapperCaddyfileAdapt checks every
// testdata/caddyfile_adapt/listener_*.caddytest: a Caddyfile, a line of
// dashes, and the JSON `caddy adapt` must produce.
func TestListenerWrapperCaddyfileAdapt(t *testing.T) {
	checkAdaptGolden(t, "testdata/caddyfile_adapt/listener_*.caddytest", *updateGolden)
}

// TestListenerWrapperForwarderExampleAdapt checks what `caddy adapt` makes
// of examples/http-forwarder.Caddyfile (the forwarder shape: ktls, then
// layer4 with ktls_session and the sandbox route) against
// testdata/caddyfile_adapt/example_http_forwarder.json, with FWD_DIR set
// and the example's other variables at their defaults.
func TestListenerWrapperForwarderExampleAdapt(t *testing.T) {
	t.Setenv("FWD_DIR", "/etc/caddy/forwarder")
	for _, name := range []string{"FWD_ADMIN", "FWD_PORT", "FWD_ALLOW", "FWD_ALLOW_PORTS"} {
		t.Setenv(name, "") // restored at cleanup
		os.Unsetenv(name)
	}
	example, err := os.ReadFile("examples/http-forwarder.Caddyfile")
	if err != nil {
		t.Fatal(err)
	}
	const golden = "testdata/caddyfile_adapt/example_http_forwarder.json"
	got := adaptIndented(t, string(example))
	if *updateGolden {
		if err := os.WriteFile(golden, []byte(got+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatal(err)
	}
	checkSameJSON(t, golden, got, string(want))
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
		"record limit":         {"key_record_limit many", `key_record_limit: "many" is not a positive integer`},
		"record limit zero":    {"key_record_limit 0", `key_record_limit: "0" is not a positive integer`},
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
