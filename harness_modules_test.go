package caddyktls

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/mholt/caddy-l4/layer4"
)

// Test-only Caddy modules (an events handler that records tunnel events, a
// layer4 handler that records placeholders, an HTTP handler that answers
// late) and `caddy adapt` helpers.

func init() { caddy.RegisterModule(eventRecorder{}) }

// eventRecorder is a test events handler that keeps every event it gets.
type eventRecorder struct{}

var recorded struct {
	sync.Mutex
	events []caddy.Event
}

func (eventRecorder) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "events.handlers.sandbox_test_recorder", New: func() caddy.Module { return new(eventRecorder) }}
}

func (eventRecorder) Handle(_ context.Context, ev caddy.Event) error {
	recorded.Lock()
	recorded.events = append(recorded.events, ev)
	recorded.Unlock()
	return nil
}

// recordedEvent waits for the event name about sandbox and returns its data.
func recordedEvent(t *testing.T, name, sandbox string) map[string]any {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		recorded.Lock()
		for _, ev := range recorded.events {
			if ev.Name() == name && ev.Data["sandbox"] == sandbox {
				recorded.Unlock()
				return ev.Data
			}
		}
		recorded.Unlock()
		if time.Now().After(deadline) {
			t.Fatalf("no %s event for %s", name, sandbox)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// recordTunnelEvents subscribes the test's event recorder to the tunnel
// events in e.cfg (recordedEvent reads them).
func (e *sandboxEnv) recordTunnelEvents() {
	e.cfg["apps"].(map[string]any)["events"] = map[string]any{"subscriptions": []any{map[string]any{
		"events":   []string{"sandbox_tunnel_opened", "sandbox_tunnel_closed"},
		"handlers": []any{map[string]any{"handler": "sandbox_test_recorder"}},
	}}}
}

// adaptCaddyfile runs the Caddyfile adapter in-process, as `caddy adapt` does.
func adaptCaddyfile(t *testing.T, caddyfile string) ([]byte, error) {
	t.Helper()
	out, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfile), map[string]any{"filename": "Caddyfile"})
	return out, err
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
			got := adaptIndented(t, caddyfile)
			if update {
				if err := os.WriteFile(file, []byte(caddyfile+"\n----------\n"+got+"\n"), 0o644); err != nil {
					t.Fatal(err)
				}
				return
			}
			checkSameJSON(t, file, got, wantJSON)
		})
	}
}

// adaptIndented adapts caddyfile and returns the JSON indented with tabs.
func adaptIndented(t *testing.T, caddyfile string) string {
	t.Helper()
	got, err := adaptCaddyfile(t, caddyfile)
	if err != nil {
		t.Fatalf("adapt: %v", err)
	}
	var buf bytes.Buffer
	if err := json.Indent(&buf, got, "", "\t"); err != nil {
		t.Fatal(err)
	}
	return buf.String()
}

// checkSameJSON fails t when got (indented by adaptIndented) differs from
// the expected JSON of golden.
func checkSameJSON(t *testing.T, golden, got, wantJSON string) {
	t.Helper()
	var want bytes.Buffer
	if err := json.Indent(&want, []byte(strings.TrimSpace(wantJSON)), "", "\t"); err != nil {
		t.Fatalf("expected JSON in %s: %v", golden, err)
	}
	if got != want.String() {
		t.Errorf("adapted JSON differs from %s.\ngot:\n%s\nwant:\n%s", golden, got, want.String())
	}
}

func init() { caddy.RegisterModule(placeholderRecorder{}) }

// placeholderRecorder is a terminal layer4 handler that resolves every key
// of tlsPlaceholderKeys with the connection's replacer and sends them, named
// after its server, to placeholdersSeen.
type placeholderRecorder struct {
	Server string `json:"server"`
}

// placeholderValue is one key as the replacer resolved it.
type placeholderValue struct {
	value any
	known bool
	text  string // what {key} becomes in a string
}

type placeholderSet struct {
	server string
	values map[string]placeholderValue
}

var placeholdersSeen = make(chan placeholderSet, 4)

func (placeholderRecorder) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "layer4.handlers.test_tls_placeholders", New: func() caddy.Module { return new(placeholderRecorder) }}
}

func (r *placeholderRecorder) Handle(cx *layer4.Connection, _ layer4.Handler) error {
	repl := cx.Replacer()
	values := make(map[string]placeholderValue)
	for _, k := range tlsPlaceholderKeys() {
		v, ok := repl.Get(k)
		values[k] = placeholderValue{value: v, known: ok, text: repl.ReplaceAll("{"+k+"}", "<unknown>")}
	}
	placeholdersSeen <- placeholderSet{server: r.Server, values: values}
	return nil
}

// tlsPlaceholderKeys lists every placeholder caddy-l4's `tls` handler
// knows, each list with its whole value, indexes in and past range, and
// malformed indexes, plus keys no handler knows.
func tlsPlaceholderKeys() []string {
	const p = tlsPlaceholderPrefix
	keys := []string{p + "version", p + "cipher_suite", p + "resumed", p + "proto", p + "proto_mutual",
		p + "server_name", p + "ech", p + "client.fingerprint", p + "client.public_key",
		p + "client.public_key_sha256", p + "client.issuer", p + "client.serial", p + "client.subject",
		p + "client.certificate_pem", p + "client.certificate_der_base64",
		// The part after the prefix is case-insensitive; the prefix is not.
		p + "CLIENT.Subject.Common_Name", "L4.TLS.version",
		p + "unknown", p + "client.unknown", p + "client.san.unknown", p + "version.0", "l4.tlsversion"}
	indexes := []string{"", ".0", ".1", ".7", ".-1", ".x", ".", "x", ".0.0"}
	for _, list := range []string{"dns_names", "emails", "ips", "uris"} {
		for _, i := range indexes {
			keys = append(keys, p+"client.san."+list+i)
		}
	}
	for _, name := range []string{"subject", "issuer"} {
		keys = append(keys, p+"client."+name+".common_name", p+"client."+name+".serial",
			p+"client."+name+".common_name.0", p+"client."+name+".unknown")
		for _, attr := range []string{"organizational_unit", "organization", "country", "locality",
			"province", "street_address", "postal_code"} {
			for _, i := range indexes {
				keys = append(keys, p+"client."+name+"."+attr+i)
			}
		}
	}
	return keys
}

func init() { caddy.RegisterModule(delayedResponder{}) }

// delayedResponder is a test HTTP handler that answers "delayed\n" after
// Delay, or ends when the request's context does (the client reset the
// stream or left). It does not read the request body.
type delayedResponder struct {
	Delay caddy.Duration `json:"delay"`
}

func (delayedResponder) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "http.handlers.test_delayed_response", New: func() caddy.Module { return new(delayedResponder) }}
}

func (d delayedResponder) ServeHTTP(w http.ResponseWriter, r *http.Request, _ caddyhttp.Handler) error {
	select {
	case <-time.After(time.Duration(d.Delay)):
		_, err := io.WriteString(w, "delayed\n")
		return err
	case <-r.Context().Done():
		return nil
	}
}
