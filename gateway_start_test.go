package caddyktls

import (
	"crypto/ed25519"
	"crypto/rand"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/internal/offload"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

// addGatewayModules adds to e's configuration (with addGatewaySide's files)
// the two gateway modules: an HTTP server whose reverse_proxy uses the
// sandbox transport (with Caddy's own TLS: no ktls listener wrapper), and
// a layer4 server with sandbox_proxy. dial is merged into both modules'
// JSON.
func addGatewayModules(t *testing.T, e *sandboxEnv, files gatewayFiles, dial map[string]any) {
	t.Helper()
	transport := files.dialJSON()
	transport["protocol"], transport["sandbox"], transport["target"] = "sandbox", "{http.request.host.labels.2}", "10.0.0.1:80"
	proxy := files.dialJSON()
	proxy["handler"], proxy["forwarder"], proxy["sandbox"], proxy["target"] = "sandbox_proxy", e.addr, "{l4.tls.server_name.labels.2}", "10.0.0.1:80"
	for k, v := range dial {
		transport[k], proxy[k] = v, v
	}
	apps := e.cfg["apps"].(map[string]any)
	apps["http"] = map[string]any{"servers": map[string]any{"gateway": map[string]any{
		"listen": []string{loopbackAddr(t)}, "automatic_https": map[string]any{"disable": true},
		"tls_connection_policies": []any{map[string]any{}},
		"routes": []any{map[string]any{"handle": []any{map[string]any{
			"handler": "reverse_proxy", "upstreams": []any{map[string]any{"dial": e.addr}}, "transport": transport}}}},
	}}}
	apps["layer4"].(map[string]any)["servers"].(map[string]any)["edge"] = map[string]any{
		"listen": []string{loopbackAddr(t)},
		"routes": []any{map[string]any{"handle": []any{map[string]any{"handler": "ktls"}, proxy}}},
	}
}

// TestGatewayStartLine: each gateway module says at start, once per
// configuration load, what this kernel does for its forwarder connections,
// as the ktls handler and the listener wrapper do for theirs: an HTTP-only
// gateway (the sandbox transport behind Caddy's own TLS) included. On a
// host without kTLS the line says why and what to do; it names what it
// says (offloaded), never "offload", which reads as the option. Two
// instances of a module with the same options log one line; a reload one
// more.
func TestGatewayStartLine(t *testing.T) {
	kernel := kerneltest.Available() == nil
	msg := offload.KernelUnavailableMsg
	if kernel {
		msg = offload.KernelAvailableMsg
	}
	e := newSandboxConfig(t, nil)
	files := addGatewaySide(t, e)
	addGatewayModules(t, e, files, nil)
	// A second sandbox transport with the same options.
	routes := e.cfg["apps"].(map[string]any)["http"].(map[string]any)["servers"].(map[string]any)["gateway"].(map[string]any)["routes"].([]any)
	second := cloneJSON(t, routes[0].(map[string]any))
	second["match"] = []any{map[string]any{"path": []string{"/second/*"}}}
	e.cfg["apps"].(map[string]any)["http"].(map[string]any)["servers"].(map[string]any)["gateway"].(map[string]any)["routes"] = []any{second, routes[0]}
	e.start(t)

	byModule := func() map[string][]map[string]any {
		out := map[string][]map[string]any{}
		for _, l := range e.logLines(t, msg) {
			out[l["logger"].(string)] = append(out[l["logger"].(string)], l)
		}
		return out
	}
	lines := byModule()
	for _, m := range moduleid.Gateway {
		if len(lines[m]) != 1 {
			t.Fatalf("%s: %d %q lines at start, want 1 (lines by module: %v)", m, len(lines[m]), msg, lines)
		}
		l := lines[m][0]
		if l["level"] != "info" || l["kernel"] == nil || l["fallback"] != "allow" {
			t.Errorf("%s start line %v: want INFO naming the kernel and fallback allow", m, l)
		}
		if _, named := l["offload"]; named {
			t.Errorf("%s start line %v has an offload field: name what it says (offloaded)", m, l)
		}
		if kernel {
			if l["offloaded"] != true || l["suites"] == nil {
				t.Errorf("%s start line %v: want offloaded and the suites", m, l)
			}
		} else if fix, _ := l["fix"].(string); l["offloaded"] != false || l["why"] == nil || !strings.Contains(fix, "modprobe tls") && !strings.Contains(fix, "CONFIG_TLS") {
			t.Errorf("%s start line %v: want offloaded false, why, and a fix", m, l)
		}
	}
	e.load(t) // the same configuration again: a new load
	for _, m := range moduleid.Gateway {
		if n := len(byModule()[m]); n != 2 {
			t.Errorf("%s: %d start lines after a reload, want 2 (one per load)", m, n)
		}
	}
}

// TestGatewayStartLineFallbackRefuse: with fallback refuse on a kernel
// that cannot offload, a gateway module's start line is the WARN that
// every tunnel will be refused, as for the other modules.
func TestGatewayStartLineFallbackRefuse(t *testing.T) {
	if kerneltest.Available() == nil {
		t.Skip("kTLS is available here: nothing is refused for want of it")
	}
	e := newSandboxConfig(t, nil)
	files := addGatewaySide(t, e)
	addGatewayModules(t, e, files, map[string]any{"require_offload": true})
	e.start(t)
	n := map[string]int{}
	for _, l := range e.logLines(t, offload.RefuseAllWarning) {
		if l["level"] != "warn" || l["fix"] == nil {
			t.Errorf("refusal line %v: want a WARN with the fix", l)
		}
		n[l["logger"].(string)]++
	}
	for _, m := range moduleid.Gateway {
		if n[m] != 1 {
			t.Errorf("%s: %d WARNs that every connection will be refused, want 1", m, n[m])
		}
	}
	for _, l := range e.logLines(t, offload.KernelUnavailableMsg) {
		if l["logger"] != moduleid.L4Handler {
			t.Errorf("%v: a refusing gateway module says only the WARN", l)
		}
	}
}

// TestGatewayKeyIDMustMatchKeyFile: a gateway module's key_id that differs
// from the Key-Id kept with its signing key does not load (every preamble
// would be refused as unknown-key), with an error that says what to give;
// the key file's own ID, or a key_id for a key file that names none,
// loads.
func TestGatewayKeyIDMustMatchKeyFile(t *testing.T) {
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	bare, err := preamble.MarshalPrivateKey(priv)
	if err != nil {
		t.Fatal(err)
	}
	bareFile := filepath.Join(t.TempDir(), "bare.key")
	if err := os.WriteFile(bareFile, bare, 0o600); err != nil {
		t.Fatal(err)
	}
	for name, tc := range map[string]struct {
		dial map[string]any
		want string // "" loads
	}{
		"another ID":       {map[string]any{"key_id": "edge-2"}, `key_id "edge-2" does not match the key ID "edge-1" kept with the key in signing_key_file `},
		"the file's ID":    {map[string]any{"key_id": gatewayKeyIDEdge}, ""},
		"no key_id":        {nil, ""},
		"a file with none": {map[string]any{"key_id": "named-here", "signing_key_file": bareFile}, ""},
	} {
		t.Run(name, func(t *testing.T) {
			e := newSandboxConfig(t, nil)
			files := addGatewaySide(t, e)
			addGatewayModules(t, e, files, tc.dial)
			raw, err := json.Marshal(e.cfg)
			if err != nil {
				t.Fatal(err)
			}
			err = caddy.Validate(mustConfig(t, raw))
			if tc.want == "" {
				if err != nil {
					t.Fatalf("does not load: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatal("loaded")
			}
			for _, w := range []string{tc.want, files.signingKey, `leave key_id out, or give "edge-1"`} {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
}
