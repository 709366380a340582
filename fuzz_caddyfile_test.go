package caddyktls

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/modules/forwarder"
)

// caddyfileModule is one Caddyfile unmarshaler of this module, and how its
// JSON is placed into a configuration that caddy.Validate provisions.
type caddyfileModule struct {
	name string // the directive, first token of its Caddyfile block
	new  func() caddyfile.Unmarshaler
	// config returns a whole configuration holding raw as this module.
	config func(raw json.RawMessage) map[string]any
}

// fuzzModules lists every Caddyfile unmarshaler of this module; the fuzz
// input's first byte picks one.
func fuzzModules(t testing.TB) []caddyfileModule {
	pub := base64.StdEncoding.EncodeToString(forwardtest.NewGateway(t, "gw-1").Pub)
	sandbox := map[string]any{"handler": "sandbox", "keys": []any{map[string]any{"id": "gw-1", "public_key": pub}}, "allow_cidrs": []string{"10.0.0.0/8"}}
	layer4 := func(match, handle []any) map[string]any {
		return map[string]any{"apps": map[string]any{"layer4": map[string]any{"servers": map[string]any{"s": map[string]any{
			"listen": []string{"127.0.0.1:0"},
			"routes": []any{map[string]any{"match": match, "handle": handle}},
		}}}}}
	}
	withHandler := func(name string) func(json.RawMessage) map[string]any {
		return func(raw json.RawMessage) map[string]any {
			var h map[string]any
			if err := json.Unmarshal(raw, &h); err != nil {
				t.Fatalf("the handler's own JSON does not decode: %v", err)
			}
			h["handler"] = name
			if name == "ktls" {
				return layer4(nil, []any{h, sandbox})
			}
			return layer4(nil, []any{h})
		}
	}
	return []caddyfileModule{
		{"ktls", func() caddyfile.Unmarshaler { return new(KTLSHandler) }, withHandler("ktls")},
		{"sandbox", func() caddyfile.Unmarshaler { return new(forwarder.Handler) }, withHandler("sandbox")},
		{"sandbox", func() caddyfile.Unmarshaler { return new(forwarder.Matcher) }, func(raw json.RawMessage) map[string]any {
			return layer4([]any{map[string]any{"sandbox": raw}}, []any{sandbox})
		}},
		{"ktls", func() caddyfile.Unmarshaler { return new(ListenerWrapper) }, func(raw json.RawMessage) map[string]any {
			var w map[string]any
			if err := json.Unmarshal(raw, &w); err != nil {
				t.Fatalf("the wrapper's own JSON does not decode: %v", err)
			}
			w["wrapper"] = "ktls"
			return map[string]any{"apps": map[string]any{"http": map[string]any{"servers": map[string]any{"s": map[string]any{
				"listen":            []string{"127.0.0.1:0"},
				"listener_wrappers": []any{w}, // after the implied tls wrapper
				"automatic_https":   map[string]any{"disable": true},
			}}}}}
		}},
		{"ktls_session", func() caddyfile.Unmarshaler { return new(KTLSSession) }, withHandler("ktls_session")},
	}
}

// FuzzCaddyfile feeds arbitrary Caddyfile blocks to every unmarshaler of
// this module (the first byte picks which). None may panic; a block one
// accepts must give JSON that decodes back to the same JSON, and the
// configuration holding it must either provision (caddy.Validate, what
// `caddy validate` runs) or fail with an error.
func FuzzCaddyfile(f *testing.F) {
	modules := fuzzModules(f)
	// Provisioning must not touch the user's Caddy storage.
	f.Setenv("XDG_DATA_HOME", f.TempDir())
	f.Setenv("XDG_CONFIG_HOME", f.TempDir())
	for i := range modules {
		for _, body := range []string{
			"",
			"{\n}",
			"{\n\toffload off\n\trx off\n\tfallback refuse\n\texpect_no_pad\n\ttx_zerocopy_ro\n\tkeyupdate_rate 10 20\n\thandshake_timeout 5s\n\tsendfile\n}",
			"{\n\tconnection_policy {\n\t\tprotocols tls1.3\n\t\tclient_auth {\n\t\t\tmode require_and_verify\n\t\t}\n\t}\n\tkeyupdate_rate 2.5\n\tresumption off\n}",
			"{\n\tkey gw-1 MCowBQYDK2VwAyEAGb9ECWmEzf6FQbrBZ9w7lshQhqowtrbLDFw4rXAxZuE=\n\trequire_channel_binding\n\tmax_clock_skew 10s\n\tmax_preamble_ttl 30s\n" +
				"\treplay_cache_size 65536\n\tpreamble_timeout 5s\n\tdial_timeout 5s\n\tkeepalive 30s\n\ttcp_user_timeout 2m\n" +
				"\tallow 10.88.0.0/16 ::1\n\tallow_ports 8000-8999 443\n\tdrain_grace_period 30s\n" +
				"\tkey_clients gw-1 gateway-1\n\tmax_tunnels_per_sandbox 8\n\tmax_tunnel_lifetime 1h\n}",
			"{\n\tkey gw-1 AAAA\n\tactivity_push http://127.0.0.1:1/activity {\n\t\tinterval 1s\n\t\ttimeout 1s\n\t\tattempts 2\n\t\tbackoff 100ms\n\t\tqueue_size 4\n\t\theader Authorization \"Bearer {env.T}\"\n\t}\n}",
			"{\n\tkeyupdate_rate 1e400\n\thandshake_timeout -1s\n}",
			"extra {\n\tsandbox\n}",
		} {
			f.Add(uint8(i), body)
		}
	}
	f.Fuzz(func(t *testing.T, which uint8, body string) {
		m := modules[int(which)%len(modules)]
		tokens, err := caddyfile.Tokenize([]byte(m.name+" "+body), "Caddyfile")
		if err != nil {
			return // not even tokens (NewTestDispenser would exit the process here)
		}
		v := m.new()
		if err := v.UnmarshalCaddyfile(caddyfile.NewDispenser(tokens)); err != nil {
			return // refused with an error: fine
		}
		raw, err := json.Marshal(v)
		if err != nil {
			t.Fatalf("%s accepted %q but its JSON fails: %v", m.name, body, err)
		}
		again := m.new()
		if err := json.Unmarshal(raw, again); err != nil {
			t.Fatalf("%s: its own JSON %s does not decode: %v", m.name, raw, err)
		}
		if raw2, err := json.Marshal(again); err != nil || !bytes.Equal(raw, raw2) {
			t.Fatalf("%s: JSON round trip changed %s into %s (%v)", m.name, raw, raw2, err)
		}
		// Provisioning reads key files and starts activity pushers (which
		// take the process's tunnel deltas and POST them): a fuzz input
		// must not make the harness read arbitrary host files (/dev/zero)
		// or send requests. Both paths have their own tests.
		if h, ok := v.(*forwarder.Handler); ok && (len(h.KeyFiles) > 0 || h.ActivityPush != nil) {
			return
		}
		cfg, err := json.Marshal(m.config(raw))
		if err != nil {
			t.Fatal(err)
		}
		var c caddy.Config
		if err := json.Unmarshal(cfg, &c); err != nil {
			t.Fatalf("configuration %s does not decode: %v", cfg, err)
		}
		_ = caddy.Validate(&c) // an error is a fine answer; a panic fails the fuzz run
	})
}
