package caddyktls

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

var updateSandboxGolden = flag.Bool("update-sandbox-golden", false, "rewrite the expected JSON of testdata/caddyfile_adapt/sandbox_*.caddytest")

// TestSandboxCaddyfileAdapt checks every
// testdata/caddyfile_adapt/sandbox_*.caddytest (Caddyfile, a line of dashes,
// the JSON `caddy adapt` must produce), which together use every option of
// the ktls and sandbox handlers and the sandbox matcher.
func TestSandboxCaddyfileAdapt(t *testing.T) {
	files, err := filepath.Glob("testdata/caddyfile_adapt/sandbox_*.caddytest")
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
			if *updateSandboxGolden {
				if err := os.WriteFile(file, []byte(caddyfile+"\n----------\n"+gotBuf.String()+"\n"), 0o644); err != nil {
					t.Fatal(err)
				}
				return
			}
			if err := json.Indent(&wantBuf, []byte(strings.TrimSpace(wantJSON)), "", "\t"); err != nil {
				t.Fatalf("expected JSON in %s: %v", file, err)
			}
			if gotBuf.String() != wantBuf.String() {
				t.Errorf("adapted JSON differs from %s:\n%s", file, gotBuf.String())
			}
		})
	}
}

// Bad Caddyfile input gets a clear error naming the problem.
func TestSandboxCaddyfileErrors(t *testing.T) {
	for _, tc := range []struct{ body, want string }{
		{"sandbox {\n\tkey only-id\n}", "key takes a key ID and a base64"},
		{"sandbox {\n\tpreamble_timeout soon\n}", "not a positive duration"},
		{"sandbox {\n\treplay_cache_size -1\n}", "not a positive integer"},
		{"sandbox {\n\tactivity_push\n}", "activity_push needs a URL"},
		{"sandbox {\n\tfrobnicate\n}", `unknown sandbox handler option "frobnicate"`},
		{"ktls {\n\trx maybe\n}", `rx: "maybe" is not one of [on off]`},
		{"ktls {\n\tkeyupdate_rate fast\n}", "not a positive number"},
		{"ktls {\n\tfrobnicate\n}", `unknown ktls handler option "frobnicate"`},
	} {
		_, err := adaptCaddyfile(t, "{\n\tlayer4 {\n\t\t:9443 {\n\t\t\troute {\n"+tc.body+"\n\t\t\t}\n\t\t}\n\t}\n}\n")
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v, want it to contain %q", tc.body, err, tc.want)
		}
	}
}
