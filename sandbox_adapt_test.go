package caddyktls

import (
	"flag"
	"strings"
	"testing"
)

var updateSandboxGolden = flag.Bool("update-sandbox-golden", false, "rewrite the expected JSON of testdata/caddyfile_adapt/sandbox_*.caddytest")

// TestSandboxCaddyfileAdapt checks every
// testdata/caddyfile_adapt/sandbox_*.caddytest (Caddyfile, a line of dashes,
// the JSON `caddy adapt` must produce), which together use every option of
// the ktls and sandbox handlers and the sandbox matcher.
func TestSandboxCaddyfileAdapt(t *testing.T) {
	checkAdaptGolden(t, "testdata/caddyfile_adapt/sandbox_*.caddytest", *updateSandboxGolden)
}

// Bad Caddyfile input gets a clear error naming the problem.
func TestSandboxCaddyfileErrors(t *testing.T) {
	for _, tc := range []struct{ body, want string }{
		{"sandbox {\n\tkey only-id\n}", "key takes a key ID and a base64"},
		{"sandbox {\n\tpreamble_timeout soon\n}", "not a positive duration"},
		{"sandbox {\n\treplay_cache_size -1\n}", "not a positive integer"},
		{"sandbox {\n\tactivity_push\n}", "activity_push needs a URL"},
		{"sandbox {\n\tfrobnicate\n}", `unknown sandbox handler option "frobnicate"`},
		{"ktls {\n\trx maybe\n}", `rx takes one of on, off, got "maybe"`},
		{"ktls {\n\tkeyupdate_rate fast\n}", "not a positive number"},
		{"ktls {\n\tfrobnicate\n}", `unknown ktls handler option "frobnicate"`},
		{"ktls_session on", "wrong argument count"},
		{"ktls_session {\n\trx off\n}", "the ktls_session handler takes no block"},
	} {
		_, err := adaptCaddyfile(t, "{\n\tlayer4 {\n\t\t:9443 {\n\t\t\troute {\n"+tc.body+"\n\t\t\t}\n\t\t}\n\t}\n}\n")
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v, want it to contain %q", tc.body, err, tc.want)
		}
	}
}
