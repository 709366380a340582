package caddyktls

import (
	"encoding/json"
	"flag"
	"os"
	"reflect"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
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
		{"sandbox {\n\tmax_tunnels_per_sandbox 0\n}", `max_tunnels_per_sandbox: "0" is not a positive integer`},
		{"sandbox {\n\tmax_tunnels_per_sandbox 8 16\n}", "wrong argument count"},
		{"sandbox {\n\tmax_tunnel_lifetime forever\n}", `max_tunnel_lifetime: "forever" is not a positive duration`},
		{"sandbox {\n\tactivity_push\n}", "activity_push needs a URL"},
		{"sandbox {\n\tkey_clients gw-1\n}", "key_clients takes a key ID and one or more client names, got 1 arguments"},
		{"sandbox {\n\tactivity_push http://x {\n\t\theader Authorization\n\t}\n}", "header takes a field name and a value, got 1 arguments"},
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

// examples/forwarder.Caddyfile (what `make demo` runs) adapts to a layer4
// server on a tcp-retry listener whose one route terminates mutual TLS with
// the gateway-certificate allowlist and hands the tunnel to the sandbox
// handler, with the demo's environment substituted.
func TestSandboxExampleAdapt(t *testing.T) {
	t.Setenv("DEMO_DIR", "/demo")
	t.Setenv("DEMO_LISTEN", "127.0.0.1:19443")
	t.Setenv("DEMO_UPSTREAM_PORT", "19000")
	raw, err := os.ReadFile("examples/forwarder.Caddyfile")
	if err != nil {
		t.Fatal(err)
	}
	out, err := adaptCaddyfile(t, string(raw))
	if err != nil {
		t.Fatalf("adapt: %v", err)
	}
	var cfg struct {
		Apps struct {
			Layer4 any `json:"layer4"`
		} `json:"apps"`
	}
	if err := json.Unmarshal(out, &cfg); err != nil {
		t.Fatal(err)
	}
	var want any
	if err := json.Unmarshal([]byte(`{"servers": {"srv0": {
		"listen": ["tcp-retry/127.0.0.1:19443"],
		"routes": [{"handle": [
			{"handler": "ktls", "connection_policies": [{"client_authentication": {
				"ca": {"provider": "file", "pem_files": ["/demo/ca.pem"]},
				"mode": "require_and_verify",
				"verifiers": [{"verifier": "leaf", "leaf_certs_loaders": [{"loader": "file", "files": ["/demo/gateway.pem"]}]}]
			}}]},
			{"handler": "sandbox", "key_files": ["/demo/gateways.pem"], "require_channel_binding": true,
				"allow_cidrs": ["127.0.0.1"], "allow_ports": ["19000"]}
		]}]
	}}}`), &want); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(cfg.Apps.Layer4, want) {
		got, _ := json.MarshalIndent(cfg.Apps.Layer4, "", "\t")
		t.Errorf("examples/forwarder.Caddyfile adapts to this layer4 app:\n%s", got)
	}
}

// Bad sandbox handler JSON is refused at load with an error naming it.
func TestSandboxRejectsBadOptions(t *testing.T) {
	for name, tc := range map[string]struct {
		opts map[string]any
		want string
	}{
		"key_clients of no key":        {map[string]any{"key_clients": map[string][]string{"gw-typo": {"gateway-1"}}}, `key_clients "gw-typo": no such key`},
		"key_clients naming no client": {map[string]any{"key_clients": map[string][]string{gatewayKeyID: {}}}, "no client named"},
		"negative tunnel cap":          {map[string]any{"max_tunnels_per_sandbox": -1}, "negative MaxTunnelsPerSandbox or MaxTunnelLifetime"},
		"negative lifetime":            {map[string]any{"max_tunnel_lifetime": "-1s"}, "negative MaxTunnelsPerSandbox or MaxTunnelLifetime"},
	} {
		t.Run(name, func(t *testing.T) {
			raw, err := json.Marshal(newSandboxConfig(t, tc.opts).cfg)
			if err != nil {
				t.Fatal(err)
			}
			err = caddy.Load(raw, true)
			if err == nil {
				caddy.Load([]byte(unloadConfig), true)
				t.Fatal("accepted")
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q does not contain %q", err, tc.want)
			}
		})
	}
}
