package caddyktls

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
)

// fakeControlPlane answers sandbox lookups at /v1/sandboxes/<id>/route
// from its routes (id → JSON answer, set at any time); other sandboxes get
// 404, "sbx-cp-down" a 500, a request without the token a 401.
type fakeControlPlane struct {
	url    string
	mu     sync.Mutex
	routes map[string]string
	seen   map[string]int
}

func newFakeControlPlane(t *testing.T) *fakeControlPlane {
	cp := &fakeControlPlane{routes: map[string]string{}, seen: map[string]int{}}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id := strings.TrimSuffix(strings.TrimPrefix(r.URL.Path, "/v1/sandboxes/"), "/route")
		cp.mu.Lock()
		cp.seen[id]++
		answer, ok := cp.routes[id]
		cp.mu.Unlock()
		switch {
		case r.Header.Get("Authorization") != "Bearer cp-token":
			http.Error(w, "who are you", http.StatusUnauthorized)
		case id == "sbx-cp-down":
			http.Error(w, "down", http.StatusInternalServerError)
		case !ok:
			http.NotFound(w, r)
		default:
			fmt.Fprint(w, answer)
		}
	}))
	t.Cleanup(srv.Close)
	cp.url = srv.URL + "/v1/sandboxes/{sandbox}/route"
	return cp
}

func (cp *fakeControlPlane) set(id, forwarder, target string) {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	cp.routes[id] = fmt.Sprintf(`{"forwarder":%q,"target":%q}`, forwarder, target)
}

func (cp *fakeControlPlane) count(id string) int {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	return cp.seen[id]
}

func (cp *fakeControlPlane) handler(module, sandbox string) map[string]any {
	return map[string]any{"handler": module, "sandbox": sandbox, "url": cp.url,
		"headers": map[string]any{"Authorization": []string{"Bearer {env.TEST_CP_TOKEN}"}}}
}

// The HTTP gateway finds each sandbox through the control plane: a known
// one is proxied to the forwarder and target the control plane named
// (asked once, then cached); an unknown one and a control plane that
// fails get 502 with the reason in the log, and nothing is proxied.
func TestSandboxLookupHTTP(t *testing.T) {
	t.Setenv("TEST_CP_TOKEN", "cp-token")
	app := startSandboxApp(t)
	cp := newFakeControlPlane(t)
	e := newTransportEnvWith(t, "{http.vars.sandbox_target}", func(cfg, _ map[string]any) map[string]any {
		route := cfg["apps"].(map[string]any)["http"].(map[string]any)["servers"].(map[string]any)["gateway"].(map[string]any)["routes"].([]any)[0].(map[string]any)
		route["handle"] = append([]any{cp.handler("sandbox_lookup", "{http.request.host.labels.2}")}, route["handle"].([]any)...)
		return map[string]any{"upstreams": []any{map[string]any{"dial": "{http.vars.sandbox_forwarder}"}}}
	}, map[string]any{"sandbox": "{http.vars.sandbox_id}"})
	cp.set("sbx-known", e.addr, app.addr)
	m0 := e.metrics(t)
	c := e.user(false)
	for range 3 {
		resp, err := c.Get(siteURL("sbx-known", "/echo?size=1000"))
		if err != nil {
			t.Fatal(err)
		}
		n, _ := io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || n != 1000 {
			t.Fatalf("known sandbox: %s with %d bytes", resp.Status, n)
		}
	}
	if n := cp.count("sbx-known"); n != 1 {
		t.Errorf("the control plane was asked %d times for 3 requests within the TTL, want 1", n)
	}
	tunnelsBefore := e.metrics(t)[tunnelsTotalSeries]
	for _, c2 := range []struct{ sandbox, reason string }{{"sbx-unknown", "not-found"}, {"sbx-cp-down", "unavailable"}} {
		resp, err := c.Get(siteURL(c2.sandbox, "/echo"))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadGateway {
			t.Errorf("%s: %s, want 502", c2.sandbox, resp.Status)
		}
		found := false
		for _, l := range e.logLines(t, "sandbox lookup failed; nothing is proxied") {
			if l["sandbox"] == c2.sandbox && l["reason"] == c2.reason {
				found = true
			}
		}
		if !found {
			t.Errorf("%s: no log line with reason %s", c2.sandbox, c2.reason)
		}
	}
	m1 := e.metrics(t)
	if m1[tunnelsTotalSeries] != tunnelsBefore {
		t.Errorf("failed lookups opened %d tunnels", m1[tunnelsTotalSeries]-tunnelsBefore)
	}
	for result, want := range map[string]int64{"control-plane": 1, "cache": 2, "not-found": 1, "unavailable": 1} {
		s := `caddy_ktls_gateway_lookups_total{module="http.handlers.sandbox_lookup",result="` + result + `"}`
		if got := m1[s] - m0[s]; got != want {
			t.Errorf("%s moved by %d, want %d", s, got, want)
		}
	}
}

// The layer4 gateway finds the sandbox by the user's server name through
// the control plane; an unknown sandbox is refused before anything is
// dialed.
func TestSandboxLookupL4(t *testing.T) {
	t.Setenv("TEST_CP_TOKEN", "cp-token")
	cp := newFakeControlPlane(t)
	size := int64(1 << 20)
	up := forwardtest.NewUpstream(t, size+3)
	e := newGatewayEnvWith(t, map[string]any{"forwarder": "{l4.sandbox.forwarder}", "sandbox": "{l4.sandbox.id}", "target": "{l4.sandbox.target}"},
		cp.handler("sandbox_lookup", "{l4.tls.server_name.labels.2}"))
	cp.set("sbx-l4", e.addr, up.Addr().String())
	n, sum, err := transfer(e.userDial(t, "sbx-l4"), size, 5)
	if err != nil {
		t.Fatal(err)
	}
	checkTunnelTransfer(t, up, size, 5, n, sum)
	m0 := e.metrics(t)
	if n, err := userEnded(t, e.userDial(t, "sbx-nowhere"), 0); n != 0 || err == nil {
		t.Errorf("unknown sandbox: read %d bytes, %v", n, err)
	}
	line := e.waitLogLine(t, "sandbox lookup failed; nothing is proxied", 0)
	if line["reason"] != "not-found" || line["sandbox"] != "sbx-nowhere" {
		t.Errorf("log line %v", line)
	}
	if got := e.metrics(t)[gatewayDialsSeries("ok")] - m0[gatewayDialsSeries("ok")]; got != 0 {
		t.Errorf("%d tunnels dialed for an unknown sandbox", got)
	}
}
