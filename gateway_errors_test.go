package caddyktls

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"

	"github.com/ktlsingress/caddy-ktls/internal/testpki"
)

// The gateway options that reverse_proxy's http transport has and a
// gateway refuses, a max_bandwidth given a rate, and a sandbox_lookup
// without its url: the Caddyfile says why and what to write instead, as
// the JSON load does, never only "unknown option" or a wrong argument
// count.
func TestGatewayCaddyfileErrorsSayWhatToDo(t *testing.T) {
	l4 := func(body string) string {
		return "{\n\tlayer4 {\n\t\t:9443 {\n\t\t\troute {\n" + body + "\n\t\t\t}\n\t\t}\n\t}\n}\n"
	}
	transport := func(opt string) string {
		return "example.com {\n\treverse_proxy 10.0.0.5:8443 {\n\t\ttransport sandbox {\n\t\t\tsandbox s\n\t\t\ttarget 10.1.0.7:8080\n\t\t\t" + opt + "\n\t\t}\n\t}\n}\n"
	}
	for _, tc := range []struct{ name, caddyfile, want string }{
		{"sandbox_proxy tls_insecure_skip_verify", l4("sandbox_proxy {\n\ttls_insecure_skip_verify\n}"),
			"tls_insecure_skip_verify: the preamble would go to whoever answers; give the forwarders' CA with tls_trust_pool"},
		{"transport tls_insecure_skip_verify", transport("tls_insecure_skip_verify"),
			"tls_insecure_skip_verify: the preamble would go to whoever answers; give the forwarders' CA with tls_trust_pool"},
		{"transport tls_timeout", transport("tls_timeout 5s"),
			"tls_timeout: use handshake_timeout, the offload options' name for it (it bounds each forwarder connection's TLS handshake)"},
		{"sandbox_proxy tls_timeout", l4("sandbox_proxy {\n\ttls_timeout 5s\n}"), "tls_timeout: use handshake_timeout"},
		{"transport tls_except_ports", transport("tls_except_ports 8080"), "tls_except_ports: every forwarder connection is TLS"},
		{"max_bandwidth inline", l4("sandbox {\n\tallow 10.0.0.0/8\n\tmax_bandwidth 2MiB\n}"),
			"max_bandwidth 2MiB: max_bandwidth takes a block, not a rate: put `to_sandbox 2MiB` and `from_sandbox 2MiB` " +
				"(bytes per second, each direction capped on its own) on lines of their own inside max_bandwidth { }"},
		{"sandbox_lookup without url", "example.com {\n\tsandbox_lookup {http.request.host.labels.2}\n\treverse_proxy 10.0.0.5:8443\n}\n",
			"sandbox_lookup: no url: give the control plane's endpoint, with {sandbox} where the sandbox ID goes, " +
				"e.g. url https://cp.internal/v1/sandboxes/{sandbox}/route"},
		{"sandbox_lookup block without url", "example.com {\n\tsandbox_lookup {http.request.host.labels.2} {\n\t\tttl 1m\n\t}\n\treverse_proxy 10.0.0.5:8443\n}\n",
			"sandbox_lookup: no url: give the control plane's endpoint"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := adaptCaddyfile(t, tc.caddyfile)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("caddy adapt: %v\nwant it to contain %q", err, tc.want)
			}
		})
	}
}

// What `caddy validate` (caddy.Validate: every module provisioned and
// validated, nothing started) says of gateway configurations that cannot
// work: a target or forwarder that is no address (the forwarder does no
// DNS; the docs say never a host name), a lookup without its url, a
// signing key file that holds an EC key or a certificate. A placeholder
// target passes: it is checked per request.
func TestGatewayValidateSaysWhatToDo(t *testing.T) {
	ca := testpki.NewCA(t, "validate CA")
	files := writeGatewayFiles(t, ca, ca.Client(t, "gateway-1"))
	dir := t.TempDir()
	ec, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, _ := x509.MarshalPKCS8PrivateKey(ec)
	ecKey := filepath.Join(dir, "ec.key")
	if err := os.WriteFile(ecKey, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	const keygen = "make one with `caddy sandbox keygen --key-out <file>`"
	transport := func(edit map[string]any) map[string]any {
		tr := files.dialJSON()
		tr["protocol"], tr["sandbox"], tr["target"] = "sandbox", "{http.request.host.labels.2}", "{vars.sandbox_target}"
		for k, v := range edit {
			tr[k] = v
		}
		return map[string]any{"apps": map[string]any{"http": map[string]any{"servers": map[string]any{"gw": map[string]any{
			"listen": []string{"127.0.0.1:0"},
			"routes": []any{map[string]any{"handle": []any{map[string]any{"handler": "reverse_proxy",
				"upstreams": []any{map[string]any{"dial": "10.0.0.5:8443"}}, "transport": tr}}}},
		}}}}}
	}
	l4 := func(handlers ...map[string]any) map[string]any {
		var handle []any
		for _, h := range handlers {
			handle = append(handle, h)
		}
		return map[string]any{"apps": map[string]any{"layer4": map[string]any{"servers": map[string]any{"gw": map[string]any{
			"listen": []string{"127.0.0.1:0"}, "routes": []any{map[string]any{"handle": handle}},
		}}}}}
	}
	proxy := func(edit map[string]any) map[string]any {
		p := files.dialJSON()
		p["handler"], p["forwarder"], p["sandbox"], p["target"] = "sandbox_proxy", "10.0.0.5:8443", "s", "10.1.0.7:22"
		for k, v := range edit {
			p[k] = v
		}
		return p
	}
	for _, tc := range []struct {
		name string
		cfg  map[string]any
		want string // "" for a configuration that validates
	}{
		{"transport target placeholder", transport(nil), ""},
		{"transport target host name", transport(map[string]any{"target": "app.internal:8080"}),
			"sandbox transport: `target` \"app.internal:8080\": want the app's private IP address and port, such as 10.1.0.7:8080 or [fd00::7]:8080, " +
				"never a host name (the forwarder does no DNS: resolve it in the control plane, or use a placeholder such as {vars.sandbox_target})"},
		{"sandbox_proxy target host name", l4(proxy(map[string]any{"target": "db.internal:5432"})),
			"sandbox_proxy: `target` \"db.internal:5432\": want the app's private IP address and port"},
		{"sandbox_proxy forwarder without port", l4(proxy(map[string]any{"forwarder": "fwd.internal"})),
			"sandbox_proxy: `forwarder` \"fwd.internal\": want the forwarder's host:port"},
		{"sandbox_proxy target placeholder", l4(proxy(map[string]any{"target": "{l4.sandbox.target}"})), ""},
		{"lookup without url", l4(map[string]any{"handler": "sandbox_lookup", "sandbox": "{l4.tls.server_name.labels.2}"}),
			"sandbox_lookup: no url: give the control plane's endpoint, with {sandbox} where the sandbox ID goes"},
		{"EC signing key", transport(map[string]any{"signing_key_file": ecKey}),
			"signing_key_file " + ecKey + ": preamble: this is an ECDSA private key (*ecdsa.PrivateKey), not Ed25519: the preamble signing key is an Ed25519 key of its own; " + keygen},
		{"certificate as signing key", transport(map[string]any{"signing_key_file": files.cert}),
			"signing_key_file " + files.cert + ": preamble: this is an X.509 certificate (PEM CERTIFICATE), not a private key: the preamble signing key is an Ed25519 key of its own, not the TLS certificate or its key; " + keygen},
		{"JSON insecure_skip_verify", transport(map[string]any{"tls": map[string]any{"client_certificate_file": files.cert, "client_certificate_key_file": files.key, "insecure_skip_verify": true}}),
			"tls_insecure_skip_verify (tls.insecure_skip_verify): the preamble would go to whoever answers; give the forwarders' CA with tls_trust_pool"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			raw, err := json.Marshal(tc.cfg)
			if err != nil {
				t.Fatal(err)
			}
			err = caddy.Validate(mustConfig(t, raw))
			switch {
			case tc.want == "" && err != nil:
				t.Errorf("caddy validate: %v, want it to pass", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Errorf("caddy validate: %v\nwant it to contain %q", err, tc.want)
			}
		})
	}
}

// debugLog makes e's Caddy log at DEBUG from its next load.
func debugLog(e *sandboxEnv) {
	e.cfg["logging"].(map[string]any)["logs"].(map[string]any)["default"].(map[string]any)["level"] = "DEBUG"
}

// A forwarder refuses a handshake, and says why on its side: the server
// name the gateway asks for is on none of its certificates (counted
// unknown-server-name; the gateway's error says so too), or the gateway's
// certificate lacks the clientAuth extended key usage or comes from a CA
// outside the trust pool (counted untrusted-certificate, its DEBUG line
// naming the certificate, its issuer and the fix).
func TestForwarderSaysWhyHandshakeFailed(t *testing.T) {
	cases := []struct {
		name     string
		edit     func(t *testing.T, e *gatewayEnv)
		reason   string
		gateway  string   // in the gateway's error
		detail   []string // in the forwarder's DEBUG line
		issuerCN string
	}{
		{name: "server name on no certificate", edit: func(t *testing.T, e *gatewayEnv) {
			e.proxyHandler()["tls"].(map[string]any)["server_name"] = "nosuch.example"
		}, reason: "unknown-server-name",
			gateway: `remote error: tls: internal error: the forwarder failed the handshake; it does so when it has no certificate for the server name "nosuch.example" (set tls_server_name to a name its certificate carries`,
			detail:  []string{"no certificate of this server carries the server name the client asked for", "tls_server_name"}},
		{name: refusedCertificates[0].name, edit: func(t *testing.T, e *gatewayEnv) {
			useGatewayCertificate(t, e.files, refusedCertificates[0].leaf(t, e.ca))
		}, reason: "untrusted-certificate", gateway: refusedCertificates[0].fix,
			detail: []string{"the client certificate lacks the clientAuth extended key usage: issue it with extKeyUsage clientAuth"}, issuerCN: "CN=test CA"},
		{name: refusedCertificates[1].name, edit: func(t *testing.T, e *gatewayEnv) {
			useGatewayCertificate(t, e.files, refusedCertificates[1].leaf(t, e.ca))
		}, reason: "untrusted-certificate", gateway: refusedCertificates[1].fix,
			detail: []string{"the client certificate's issuer is not in this client_auth trust_pool: add the gateway's CA there"}, issuerCN: "CN=other CA"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := newGatewayEnv(t, map[string]any{"target": "127.0.0.1:9"})
			tc.edit(t, e)
			debugLog(e.sandboxEnv)
			reloaded(t, e.sandboxEnv)
			m0 := e.metrics(t)
			if n, err := userEnded(t, e.userDial(t, uniqueSandbox("sbx-why")), 0); n != 0 || err == nil {
				t.Errorf("user read %d bytes, err %v: want the connection refused", n, err)
			}
			line := e.waitLogLine(t, "sandbox_proxy: cannot open the tunnel; refused, nothing reached the sandbox", 0)
			if msg, _ := line["error"].(string); !strings.Contains(msg, "handshake: ") || !strings.Contains(msg, tc.gateway) {
				t.Errorf("gateway log error %q, want it to say %q", msg, tc.gateway)
			}
			failed := e.waitLogLine(t, "TLS handshake failed", 0)
			fix, _ := failed["fix"].(string)
			if failed["reason"] != tc.reason || failed["logger"] != "layer4.handlers.ktls" {
				t.Errorf("forwarder DEBUG line %v: want reason %s from layer4.handlers.ktls", failed, tc.reason)
			}
			for _, d := range tc.detail {
				if !strings.Contains(fix, d) {
					t.Errorf("forwarder DEBUG line fix %q, want it to say %q", fix, d)
				}
			}
			if tc.issuerCN != "" && (failed["issuer"] != tc.issuerCN || failed["client_certificate"] != "CN=gateway-1") {
				t.Errorf("forwarder DEBUG line %v: want client_certificate CN=gateway-1 issued by %s", failed, tc.issuerCN)
			}
			checkMetricDeltas(t, m0, e.metrics(t), map[string]int64{forwarderFailuresSeries(tc.reason): 1, forwarderFailuresSeries("other"): 0,
				forwarderFailuresSeries("no-client-certificate"): 0, gatewayDialsSeries("handshake"): 1, gatewayDialsSeries("ok"): 0})
		})
	}
}
