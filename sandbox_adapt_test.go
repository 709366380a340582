package caddyktls

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/ktlsingress/caddy-ktls/modules/forwarder"
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
		{"sandbox {\n\tactivity_push\n}", "activity_push needs the control plane's URL"},
		{"sandbox {\n\tproxy_protocol\n}", "proxy_protocol needs a version: v2"},
		{"sandbox {\n\tproxy_protocol v1\n}", `proxy_protocol "v1": the only version is v2`},
		{"sandbox {\n\tproxy_protocol v2 v2\n}", "wrong argument count"},
		{"sandbox {\n\tkey_clients gw-1\n}", "key_clients takes a key ID and one or more client names, got 1 arguments"},
		{"sandbox {\n\tactivity_push http://x {\n\t\theader Authorization\n\t}\n}", "header takes a field name and a value, got 1 arguments"},
		{"sandbox {\n\tinsecure_plaintext yes\n}", "insecure_plaintext takes no arguments"},
		{"sandbox {\n\tnat64_prefix\n}", "wrong argument count"},
		{"sandbox {\n\tfrobnicate\n}", `unknown sandbox handler option "frobnicate"`},
		{"ktls {\n\trx maybe\n}", `rx takes one of on, off, got "maybe"`},
		{"ktls {\n\tkeyupdate_rate fast\n}", "not a positive number"},
		{"ktls {\n\tfrobnicate\n}", `unknown ktls handler option "frobnicate"`},
		{"ktls {\n\tmax_handshakes 0\n}", `max_handshakes: "0" is not a positive integer`},
		{"ktls {\n\tmax_handshakes off 2\n}", "wrong argument count"},
		{"ktls {\n\tmax_scheduling_delay 0s\n}", `max_scheduling_delay: "0s" is not a positive duration`},
		{"ktls {\n\tmax_scheduling_delay\n}", "wrong argument count"},
		{"sandbox {\n\tmax_dials none\n}", `max_dials: "none" is not a positive integer`},
		{"sandbox {\n\tmax_dials\n}", "wrong argument count"},
		{"sandbox {\n\tstandby maybe\n}", `standby takes one of on, off, got "maybe"`},
		{"sandbox {\n\tmax_standby_per_client 0\n}", `max_standby_per_client: "0" is not a positive integer`},
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
	t.Setenv("FWD_DIR", "/demo")
	t.Setenv("FWD_LISTEN", "127.0.0.1:19443")
	t.Setenv("FWD_ALLOW", "127.0.0.1")
	t.Setenv("FWD_ALLOW_PORTS", "19000-19001")
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
				"allow_cidrs": ["127.0.0.1"], "allow_ports": ["19000-19001"]}
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
		"key_clients of no key":        {map[string]any{"key_clients": map[string][]string{"gw-typo": {"gateway-1"}}}, "`key_clients` \"gw-typo\": no such key"},
		"key_clients naming no client": {map[string]any{"key_clients": map[string][]string{gatewayKeyID: {}}}, "no client named"},
		"negative tunnel cap":          {map[string]any{"max_tunnels_per_sandbox": -1}, "`max_tunnels_per_sandbox` must not be negative"},
		"negative lifetime":            {map[string]any{"max_tunnel_lifetime": "-1s"}, "`max_tunnel_lifetime` must not be negative"},
		"proxy_protocol v1":            {map[string]any{"proxy_protocol": "v1"}, "`proxy_protocol` \"v1\": the only version is v2 (PROXY protocol version 2)"},
		"no allow entry":               {map[string]any{"allow_cidrs": []string{}}, "sandbox handler: no `allow` (JSON allow_cidrs) entry: name the sandbox networks this forwarder may reach, e.g. `allow 10.0.0.0/8`"},
		"allow_ports but no allow":     {map[string]any{"allow_cidrs": nil, "allow_ports": []string{"443"}}, "no `allow` (JSON allow_cidrs) entry"},
		"nat64 prefix of no RFC 6052 length": {map[string]any{"nat64_prefixes": []string{"2001:db8::/33"}},
			"`nat64_prefix` (JSON nat64_prefixes): target policy: NAT64 prefix \"2001:db8::/33\": RFC 6052 prefixes are /32, /40, /48, /56, /64 or /96"},
		"nat64 prefix with a u octet": {map[string]any{"nat64_prefixes": []string{"2001:db8:0:0:100::/96"}}, "bits 64-71 of a /96 must be zero"},
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

// A sandbox handler loads only where a TLS-terminating handler (ktls, or
// caddy-l4's tls) runs before it on every path: before it in its route,
// or before the subroute holding it in an enclosing route, or, in a layer4
// listener wrapper, Caddy's TLS ahead of the wrapper. Without one the load
// fails saying what to add, wherever in the layer4 app the handler is; a
// TLS handler in another route, which may not run, does not count.
// insecure_plaintext (tests only) skips the check.
func TestSandboxNeedsTLSHandlerBefore(t *testing.T) {
	e := newSandboxConfig(t, nil)
	ktlsHandler, sandbox := e.route()["handle"].([]any)[0], e.sandboxHandler()
	tlsHandler := map[string]any{"handler": "tls", "connection_policies": []any{map[string]any{}}}
	insecure := map[string]any{"insecure_plaintext": true}
	for k, v := range sandbox {
		insecure[k] = v
	}
	route := func(handlers ...any) map[string]any { return map[string]any{"handle": handlers} }
	subroute := func(routes ...any) map[string]any { return map[string]any{"handler": "subroute", "routes": routes} }
	layer4 := func(servers map[string][]any) map[string]any {
		srvs := map[string]any{}
		for name, routes := range servers {
			srvs[name] = map[string]any{"listen": []string{"127.0.0.1:0"}, "routes": routes}
		}
		return map[string]any{"layer4": map[string]any{"servers": srvs}}
	}
	http := func(wrappers ...any) map[string]any {
		return map[string]any{"http": map[string]any{"servers": map[string]any{"s": map[string]any{
			"listen": []string{"127.0.0.1:0"}, "listener_wrappers": wrappers, "automatic_https": map[string]any{"disable": true},
		}}}}
	}
	layer4Wrapper := func(routes ...any) map[string]any { return map[string]any{"wrapper": "layer4", "routes": routes} }
	const want = "the sandbox handler needs a TLS-terminating handler (ktls, or caddy-l4's tls with client authentication) before it in its route: add `ktls { ... }`"
	for _, tc := range []struct {
		name  string
		apps  map[string]any
		where string // in the error; "" when the configuration loads
	}{
		{"sandbox alone", layer4(map[string][]any{"a": {route(sandbox)}}), `layer4 server "a", route 0, handler 0`},
		{"sandbox before ktls", layer4(map[string][]any{"a": {route(sandbox, ktlsHandler)}}), `layer4 server "a", route 0, handler 0`},
		{"subroute without tls", layer4(map[string][]any{"a": {route(subroute(route(sandbox)))}}),
			`layer4 server "a", route 0, handler 0 (subroute), route 0, handler 0`},
		{"ktls in an earlier route", layer4(map[string][]any{"a": {route(ktlsHandler), route(sandbox)}}), `layer4 server "a", route 1, handler 0`},
		{"one bare server of two", layer4(map[string][]any{"a": {route(ktlsHandler, sandbox)}, "b": {route(sandbox)}}), `layer4 server "b", route 0, handler 0`},
		{"listener wrapper before tls", http(layer4Wrapper(route(sandbox)), map[string]any{"wrapper": "tls"}),
			"listener_wrappers[0] (layer4), route 0, handler 0"},

		{"ktls then sandbox", layer4(map[string][]any{"a": {route(ktlsHandler, sandbox)}}), ""},
		{"caddy-l4 tls then sandbox", layer4(map[string][]any{"a": {route(tlsHandler, sandbox)}}), ""},
		{"ktls then subroute", layer4(map[string][]any{"a": {route(ktlsHandler, subroute(route(sandbox)))}}), ""},
		{"insecure_plaintext", layer4(map[string][]any{"a": {route(insecure)}}), ""},
		{"listener wrapper after tls", http(layer4Wrapper(route(sandbox))), ""},
		// Where the route cannot be read (a caddy-l4 tee branch), the load
		// warns that it could not check; each connection is still checked.
		{"unreadable: in a tee branch", layer4(map[string][]any{"a": {route(map[string]any{"handler": "tee", "branch": []any{sandbox}})}}), ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			logFile, err := validateLogged(t, tc.apps)
			switch {
			case tc.where == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case tc.where != "" && (err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "("+tc.where+")")):
				t.Fatalf("error %v; want one naming (%s) and saying %q", err, tc.where, want)
			}
			// Each verdict came from reading the route, not from giving up,
			// unless the route is unreadable.
			unreadable := strings.HasPrefix(tc.name, "unreadable")
			if n := len((&sandboxEnv{logFile: logFile}).logLines(t, forwarder.RouteNotVisibleWarning)); (n == 1) != unreadable || n > 1 {
				t.Errorf("%d handlers could not read their route, want %d", n, map[bool]int{true: 1}[unreadable])
			}
			if n := len((&sandboxEnv{logFile: logFile}).logLines(t, forwarder.InsecurePlaintextWarning)); (n > 0) != (tc.name == "insecure_plaintext") {
				t.Errorf("%d insecure_plaintext warnings", n)
			}
		})
	}
}

// A sandbox matcher in the same route as a TLS-terminating handler (ktls,
// or caddy-l4's tls) never matches: the route's matchers read the
// still-encrypted stream before its handlers run. The load fails naming the
// route and the fix. A matcher with no TLS-terminating handler before its
// route at all loads with a WARN naming the fix (a plaintext preamble may be
// meant: insecure_plaintext). The documented shape, ktls then a subroute
// whose route matches sandbox, loads without a word.
func TestSandboxMatcherPlacement(t *testing.T) {
	e := newSandboxConfig(t, nil)
	ktlsHandler, sandbox := e.route()["handle"].([]any)[0], e.sandboxHandler()
	tlsHandler := map[string]any{"handler": "tls", "connection_policies": []any{map[string]any{}}}
	proxy := map[string]any{"handler": "proxy", "upstreams": []any{map[string]any{"dial": []string{"127.0.0.1:1"}}}}
	insecure := map[string]any{"insecure_plaintext": true}
	for k, v := range sandbox {
		insecure[k] = v
	}
	matchSandbox := []any{map[string]any{"sandbox": map[string]any{}}}
	route := func(handlers ...any) map[string]any { return map[string]any{"handle": handlers} }
	matched := func(handlers ...any) map[string]any { return map[string]any{"match": matchSandbox, "handle": handlers} }
	subroute := func(routes ...any) map[string]any { return map[string]any{"handler": "subroute", "routes": routes} }
	layer4 := func(routes ...any) map[string]any {
		return map[string]any{"layer4": map[string]any{"servers": map[string]any{
			"a": map[string]any{"listen": []string{"127.0.0.1:0"}, "routes": routes},
		}}}
	}
	const (
		besideErr = "it is in the same route as the %s handler (handler 0), so it runs before that handler, on the still-encrypted stream (a TLS ClientHello), and never matches: put ktls first and the matcher in a subroute after it"
	)
	for _, tc := range []struct {
		name    string
		apps    map[string]any
		errWant string // "" when the configuration loads
		warned  string // the "where" of the one WARN, "" for none
	}{
		{"beside ktls", layer4(matched(ktlsHandler, sandbox)), `sandbox matcher (layer4 server "a", route 0): ` + fmt.Sprintf(besideErr, "ktls"), ""},
		{"beside tls", layer4(matched(tlsHandler, sandbox)), `sandbox matcher (layer4 server "a", route 0): ` + fmt.Sprintf(besideErr, "tls"), ""},
		{"beside ktls in a later route", layer4(route(ktlsHandler, sandbox), matched(ktlsHandler, subroute(route(sandbox)))),
			`sandbox matcher (layer4 server "a", route 1): ` + fmt.Sprintf(besideErr, "ktls"), ""},
		{"beside ktls in a subroute", layer4(route(ktlsHandler, subroute(matched(ktlsHandler, sandbox)))),
			`sandbox matcher (layer4 server "a", route 0, handler 1 (subroute), route 0): ` + fmt.Sprintf(besideErr, "ktls"), ""},
		{"before any tls", layer4(matched(proxy), route(ktlsHandler, sandbox)), "", `layer4 server "a", route 0`},

		{"documented shape", layer4(route(ktlsHandler, subroute(matched(sandbox), route(proxy)))), "", ""},
		{"tls then subroute", layer4(route(tlsHandler, subroute(matched(sandbox)))), "", ""},
		{"insecure_plaintext", layer4(matched(insecure)), "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			logFile, err := validateLogged(t, tc.apps)
			switch {
			case tc.errWant == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case tc.errWant != "" && (err == nil || !strings.Contains(err.Error(), tc.errWant)):
				t.Fatalf("error %v; want one saying %q", err, tc.errWant)
			}
			lines := (&sandboxEnv{logFile: logFile}).logLines(t, forwarder.SandboxMatcherWarning)
			switch {
			case tc.warned == "" && len(lines) != 0:
				t.Errorf("warned %d times: %v", len(lines), lines)
			case tc.warned != "" && (len(lines) != 1 || lines[0]["where"] != tc.warned || lines[0]["level"] != "warn" ||
				!strings.Contains(fmt.Sprint(lines[0]["fix"]), "put ktls first and the matcher in a subroute after it")):
				t.Errorf("warnings %v, want one at %s", lines, tc.warned)
			}
		})
	}
}

// TestSandboxMatcherPlacementCaddyfile: the documented Caddyfile shape
// (testdata sandbox_all_options: ktls, then a subroute with @tunnel
// sandbox) passes the placement check; the matcher beside ktls does not.
func TestSandboxMatcherPlacementCaddyfile(t *testing.T) {
	good := `{
	layer4 {
		127.0.0.1:0 {
			route {
				ktls
				subroute {
					@t sandbox
					route @t {
						sandbox {
							key gw-1 MCowBQYDK2VwAyEAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=
							allow 10.0.0.0/8
						}
					}
					route {
						proxy 127.0.0.1:8080
					}
				}
			}
		}
	}
}
`
	bad := `{
	layer4 {
		127.0.0.1:0 {
			@t sandbox
			route @t {
				ktls
				sandbox {
					key gw-1 MCowBQYDK2VwAyEAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=
					allow 10.0.0.0/8
				}
			}
		}
	}
}
`
	for _, tc := range []struct{ name, caddyfile, want string }{
		{"documented", good, ""},
		{"beside ktls", bad, `sandbox matcher (layer4 server "srv0", route 0): it is in the same route as the ktls handler`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			adapter := caddyconfig.GetAdapter("caddyfile")
			raw, _, err := adapter.Adapt([]byte(tc.caddyfile), nil)
			if err != nil {
				t.Fatal(err)
			}
			err = caddy.Validate(mustConfig(t, raw))
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("error %v; want one saying %q", err, tc.want)
			}
		})
	}
}

// validateLogged validates a config of apps (as `caddy validate` does)
// with the default log written as JSON to a file, and returns the file and
// Validate's error.
func validateLogged(t *testing.T, apps map[string]any) (logFile string, err error) {
	t.Helper()
	logFile = filepath.Join(t.TempDir(), "caddy.log")
	raw, err := json.Marshal(map[string]any{"admin": map[string]any{"disabled": true}, "apps": apps,
		"logging": map[string]any{"logs": map[string]any{"default": map[string]any{
			"writer":  map[string]any{"output": "file", "filename": logFile, "roll": false},
			"encoder": map[string]any{"format": "json"},
		}}}})
	if err != nil {
		t.Fatal(err)
	}
	return logFile, caddy.Validate(mustConfig(t, raw))
}
