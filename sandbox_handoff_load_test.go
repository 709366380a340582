package caddyktls

import (
	"encoding/base64"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/mholt/caddy-l4/layer4"
)

// handoffListenerFix is the end of the load error for a listener that
// serves the sandbox handler and is no tcp-handoff address.
const handoffListenerFix = "which is no tcp-handoff/ address: the new process of an upgrade would accept there and open tunnels " +
	"before it holds the running process's state, and the upgrade would fail; listen on "

// With sandbox_handoff, every listen address of a server that serves the
// sandbox handler is a tcp-handoff/ address, or the configuration does
// not load: the error names the server, the address and the tcp-handoff/
// address to listen on instead. It holds for a layer4 server whose routes
// hold the handler at any depth and for an HTTP server whose layer4
// listener wrapper does; a server without a sandbox handler, and any
// listener without sandbox_handoff, load as before.
func TestLoadHandoffNeedsTCPHandoffListeners(t *testing.T) {
	e := newSandboxConfig(t, nil)
	handoffConfig(e, handoffSocket(t))
	other := loopbackAddr(t)
	unixPath := filepath.Join(t.TempDir(), "fwd.sock")
	sandbox := e.sandboxHandler()
	type shape func(cfg map[string]any)
	listen := func(addrs ...string) shape {
		return func(cfg map[string]any) { layer4Server(cfg, "tunnels")["listen"] = addrs }
	}
	withRoutes := func(handlers ...any) shape {
		return func(cfg map[string]any) {
			layer4Server(cfg, "tunnels")["routes"] = []any{map[string]any{"handle": handlers}}
		}
	}
	ktlsHandler := e.route()["handle"].([]any)[0]
	addServer := func(name string, addrs []string, handlers ...any) shape {
		return func(cfg map[string]any) {
			servers := cfg["apps"].(map[string]any)["layer4"].(map[string]any)["servers"].(map[string]any)
			servers[name] = map[string]any{"listen": addrs, "routes": []any{map[string]any{"handle": handlers}}}
		}
	}
	noHandoff := func(cfg map[string]any) { delete(cfg["apps"].(map[string]any), "sandbox_handoff") }
	httpWrapper := func(addr string) shape {
		return func(cfg map[string]any) {
			apps := cfg["apps"].(map[string]any)
			delete(apps, "layer4")
			apps["http"] = map[string]any{"servers": map[string]any{"fwd": map[string]any{
				"listen": []string{addr}, "protocols": []string{"h1", "h2"}, "automatic_https": map[string]any{"disable": true},
				"listener_wrappers": []any{map[string]any{"wrapper": "layer4", "routes": []any{map[string]any{
					"match": []any{map[string]any{"sandbox": map[string]any{}}}, "handle": []any{sandbox},
				}}}},
			}}}
		}
	}
	on := func(server, addr string) string {
		return `layer4 server "` + server + `" serves the sandbox handler on "` + addr + `"`
	}
	// An edge gateway's sandbox_proxy server, checked the same way.
	proxy := addGatewaySide(t, e).dialJSON()
	proxy["handler"], proxy["forwarder"], proxy["sandbox"], proxy["target"] = "sandbox_proxy", e.addr, "{l4.tls.server_name.labels.2}", "127.0.0.1:9"
	for _, tc := range []struct {
		name   string
		shapes []shape
		want   string // the error's start after "sandbox_handoff: "; "" when it loads
		fix    string
	}{
		{"bare address", []shape{listen(e.addr)}, on("tunnels", e.addr), "tcp-handoff/" + e.addr},
		{"tcp/", []shape{listen("tcp/" + e.addr)}, on("tunnels", "tcp/"+e.addr), "tcp-handoff/" + e.addr},
		{"tcp-retry/", []shape{listen("tcp-retry/" + e.addr)}, on("tunnels", "tcp-retry/"+e.addr), "tcp-handoff/" + e.addr},
		{"unix socket", []shape{listen("unix/" + unixPath)}, on("tunnels", "unix/"+unixPath), "a tcp-handoff/<host>:<port> address"},
		{"second address", []shape{listen("tcp-handoff/"+e.addr, other)}, on("tunnels", other), "tcp-handoff/" + other},
		{"sandbox in a subroute", []shape{listen(e.addr), withRoutes(ktlsHandler, map[string]any{"handler": "subroute",
			"routes": []any{map[string]any{"handle": []any{sandbox}}}})}, on("tunnels", e.addr), "tcp-handoff/" + e.addr},
		{"sandbox in a tee branch", []shape{listen(e.addr), withRoutes(ktlsHandler, map[string]any{"handler": "tee", "branch": []any{sandbox}})},
			on("tunnels", e.addr), "tcp-handoff/" + e.addr},
		{"a second sandbox server", []shape{addServer("more", []string{other}, ktlsHandler, sandbox)},
			on("more", other), "tcp-handoff/" + other},
		{"http server's layer4 wrapper", []shape{httpWrapper(e.addr)},
			`http server "fwd" (a layer4 listener wrapper) serves the sandbox handler on "` + e.addr + `"`, "tcp-handoff/" + e.addr},

		{"a sandbox_proxy server", []shape{addServer("edge", []string{other}, ktlsHandler, proxy)},
			`layer4 server "edge" serves the sandbox_proxy handler on "` + other + `"`, "tcp-handoff/" + other},

		{"tcp-handoff/", nil, "", ""},
		{"a sandbox_proxy server on tcp-handoff/", []shape{addServer("edge", []string{"tcp-handoff/" + other}, ktlsHandler, proxy)}, "", ""},
		{"a server without sandbox", []shape{addServer("plain", []string{other}, ktlsHandler)}, "", ""},
		{"http server on tcp-handoff/", []shape{httpWrapper("tcp-handoff/" + e.addr)}, "", ""},
		{"no sandbox_handoff", []shape{listen(e.addr), noHandoff}, "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := cloneJSON(t, e.cfg)
			for _, s := range tc.shapes {
				s(cfg)
			}
			err := validateConfig(t, cfg)
			checkHandoffListenerError(t, err, tc.want, tc.fix)
		})
	}

	// caddy run: the same refusal; a reload keeps the running configuration.
	bad := cloneJSON(t, e.cfg)
	listen(e.addr)(bad)
	wantBad := on("tunnels", e.addr)
	checkHandoffListenerError(t, loadConfig(t, bad), wantBad, "tcp-handoff/"+e.addr)
	e.load(t)
	t.Cleanup(func() { caddy.Load([]byte(unloadConfig), true) })
	checkHandoffListenerError(t, loadConfig(t, bad), wantBad, "tcp-handoff/"+e.addr)
	if c, err := net.DialTimeout("tcp", e.addr, 5*time.Second); err != nil {
		t.Errorf("after the refused reload, the running configuration's listener: %v", err)
	} else {
		c.Close()
	}
	if a, err := caddy.ActiveContext().AppIfConfigured("layer4"); err != nil {
		t.Errorf("after the refused reload: %v", err)
	} else if got := a.(*layer4.App).Servers["tunnels"].Listen; !slices.Equal(got, []string{"tcp-handoff/" + e.addr}) {
		t.Errorf("after the refused reload, the running configuration listens on %q", got)
	}
	// An HTTP server listens on tcp-handoff/ as a layer4 server does (its
	// Start, which the load runs, fails on an address it cannot listen on).
	httpCfg := cloneJSON(t, e.cfg)
	httpWrapper("tcp-handoff/" + e.addr)(httpCfg)
	if err := loadConfig(t, httpCfg); err != nil {
		t.Errorf("an HTTP server on tcp-handoff/: %v", err)
	}
}

// The Caddyfile gives the same refusal: a layer4 server on a plain address
// with sandbox_handoff does not load; on tcp-handoff/ it does.
func TestLoadHandoffCaddyfileNeedsTCPHandoffListeners(t *testing.T) {
	e := newSandboxConfig(t, nil)
	caddyfile := func(addr string) string {
		return "{\n\tadmin off\n\tsandbox_handoff " + handoffSocket(t) + "\n\tlayer4 {\n\t\t" + addr + " {\n\t\t\troute {\n" +
			"\t\t\t\tktls\n\t\t\t\tsandbox {\n\t\t\t\t\tkey " + gatewayKeyID + " " + base64.StdEncoding.EncodeToString(e.gw.Pub) +
			"\n\t\t\t\t\tallow 127.0.0.0/8\n\t\t\t\t}\n\t\t\t}\n\t\t}\n\t}\n}\n"
	}
	for _, tc := range []struct{ addr, want, fix string }{
		{e.addr, `layer4 server "srv0" serves the sandbox handler on "` + e.addr + `"`, "tcp-handoff/" + e.addr},
		{"tcp-handoff/" + e.addr, "", ""},
	} {
		out, err := adaptCaddyfile(t, caddyfile(tc.addr))
		if err != nil {
			t.Fatalf("%s: adapt: %v", tc.addr, err)
		}
		var cfg map[string]any
		if err := json.Unmarshal(out, &cfg); err != nil {
			t.Fatal(err)
		}
		checkHandoffListenerError(t, validateConfig(t, cfg), tc.want, tc.fix)
	}
}

// handoffSocket returns a path for a handoff socket in a new directory,
// short enough for a Unix socket's address.
func handoffSocket(t *testing.T) string {
	dir, err := os.MkdirTemp("", "handoff")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return filepath.Join(dir, "h.sock")
}

func layer4Server(cfg map[string]any, name string) map[string]any {
	return cfg["apps"].(map[string]any)["layer4"].(map[string]any)["servers"].(map[string]any)[name].(map[string]any)
}

func validateConfig(t *testing.T, cfg map[string]any) error {
	t.Helper()
	raw, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return caddy.Validate(mustConfig(t, raw))
}

func loadConfig(t *testing.T, cfg map[string]any) error {
	t.Helper()
	raw, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return caddy.Load(raw, true)
}

// checkHandoffListenerError checks err against the refusal of a listener
// that is no tcp-handoff address: "sandbox_handoff: "+want, then the
// reason and fix; want "" is no error.
func checkHandoffListenerError(t *testing.T, err error, want, fix string) {
	t.Helper()
	switch {
	case want == "" && err != nil:
		t.Errorf("refused: %v", err)
	case want != "" && err == nil:
		t.Errorf("loaded; want an error with %q", want)
	case want != "" && !strings.Contains(err.Error(), "sandbox_handoff: "+want+", "+handoffListenerFix+fix):
		t.Errorf("error %q\nwant one with %q", err, "sandbox_handoff: "+want+", "+handoffListenerFix+fix)
	}
}
