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

	"github.com/ktlsingress/caddy-ktls/preamble"
)

// TestLoadErrorsNameOptionsAndFix: the sandbox and ktls handlers' load
// errors name the Caddyfile option (and the JSON field where it differs:
// a load error cannot tell which form the configuration came in), say the
// fix, and come from Validate (caddy.Validator: Caddy reports them as
// "invalid configuration") where they need nothing loaded. key_clients
// says which of its two errors applies; a private key given as key_file
// says so.
func TestLoadErrorsNameOptionsAndFix(t *testing.T) {
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	privPEM, err := preamble.MarshalSigningKey("gw-9", priv)
	if err != nil {
		t.Fatal(err)
	}
	privFile := filepath.Join(t.TempDir(), "gw.key")
	if err := os.WriteFile(privFile, privPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	const invalid = "invalid configuration"
	for name, tc := range map[string]struct {
		sandbox, ktls map[string]any
		want, not     []string
	}{
		"key_clients of no key": {sandbox: map[string]any{"key_clients": map[string][]string{"gw-404": {"gateway-1"}}},
			want: []string{invalid, "`key_clients` \"gw-404\": no such key", "`key` (JSON keys)", "`key_file` (JSON key_files)", "the keys are " + gatewayKeyID, "correct the ID, or add the key"},
			not:  []string{"no client named"}},
		"key_clients naming no client": {sandbox: map[string]any{"key_clients": map[string][]string{gatewayKeyID: {}}},
			want: []string{"`key_clients` \"" + gatewayKeyID + "\": no client named", "e.g. `key_clients " + gatewayKeyID + " gateway-1`"},
			not:  []string{"no such key"}},
		"no allow": {sandbox: map[string]any{"allow_cidrs": []string{}},
			want: []string{"no `allow` (JSON allow_cidrs) entry", "e.g. `allow 10.0.0.0/8`"}},
		"negative drain": {sandbox: map[string]any{"drain_grace_period": "-1s"},
			want: []string{"`drain_grace_period` must not be negative", "or leave it out (30s)"}},
		"activity_push instance with a slash": {sandbox: map[string]any{"activity_push": map[string]any{"url": "http://127.0.0.1:1/a", "instance": "fwd/1"}},
			want: []string{"`activity_push instance` (JSON activity_push.instance)", `instance name "fwd/1": a slash or a control character`, "or leave it out (the host name)"}},
		"bad allow": {sandbox: map[string]any{"allow_cidrs": []string{"10.0.0.0/33"}},
			want: []string{"`allow` (JSON allow_cidrs)"}},
		"private key as key_file": {sandbox: map[string]any{"keys": nil, "key_files": []string{privFile}},
			want: []string{"`key_file` (JSON key_files) " + privFile, "this is a private key", "not a keyring"}},
		"offload off, fallback refuse": {ktls: map[string]any{"disable_offload": true, "require_offload": true},
			want: []string{invalid, "ktls handler: `offload off` (JSON disable_offload) and `fallback refuse` (JSON require_offload) together would refuse every connection: remove one of them"}},
		"key_record_limit": {ktls: map[string]any{"key_record_limit": 1 << 25},
			want: []string{invalid, "`key_record_limit` 33554432 is above 16777216", "give at most 16777216, or leave it out"}},
		"negative keyupdate_rate": {ktls: map[string]any{"keyupdate_rate": -1},
			want: []string{invalid, "`keyupdate_rate` (JSON keyupdate_rate, keyupdate_burst) must not be negative"}},
		"negative max_scheduling_delay": {ktls: map[string]any{"max_scheduling_delay": "-5ms"},
			want: []string{invalid, "`max_scheduling_delay` -5ms must not be negative", "give a positive duration, or leave it out (no bound)"}},
	} {
		t.Run(name, func(t *testing.T) {
			e := newSandboxConfig(t, tc.sandbox)
			for k, v := range tc.ktls {
				e.route()["handle"].([]any)[0].(map[string]any)[k] = v
			}
			raw, err := json.Marshal(e.cfg)
			if err != nil {
				t.Fatal(err)
			}
			err = caddy.Validate(mustConfig(t, raw))
			if err == nil {
				t.Fatal("validated")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
			for _, n := range tc.not {
				if strings.Contains(err.Error(), n) {
					t.Errorf("error %q contains %q, which does not apply", err, n)
				}
			}
		})
	}
}
