package caddyktls

import (
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward"
	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/cli"
	"github.com/ktlsingress/caddy-ktls/modules/edgegateway"
	"github.com/ktlsingress/caddy-ktls/modules/forwarder"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

// Sandbox IDs are case-insensitive. Through the layer4 gateway, a user
// who asks for SBX-LIM2 (the server name keeps its case) and one who asks
// for sbx-lim2 reach one sandbox: the forwarder's max_tunnels_per_sandbox
// of 2 refuses a third tunnel in a third spelling (tunnel-limit, before
// its target is dialed), the open tunnels and the activity report carry
// the lowercase ID alone, and the bytes of both spellings add up in one
// entry.
func TestSandboxIDCaseIsOneSandbox(t *testing.T) {
	const reply = 1000
	sandbox := uniqueSandbox("sbx-lim2")
	upper := strings.ToUpper(sandbox)
	mixed := "Sbx" + sandbox[3:]
	var mu sync.Mutex
	pushed := map[string][2]int64{} // sandbox as reported: bytes to, from
	push := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var rep forward.ActivityReport
		if err := json.NewDecoder(r.Body).Decode(&rep); err != nil {
			t.Errorf("activity report: %v", err)
		}
		mu.Lock()
		for _, d := range rep.Sandboxes {
			if strings.EqualFold(d.Sandbox, sandbox) {
				p := pushed[d.Sandbox]
				pushed[d.Sandbox] = [2]int64{p[0] + d.BytesToSandbox, p[1] + d.BytesFromSandbox}
			}
		}
		mu.Unlock()
		w.Header().Set("Connection", "close")
	}))
	t.Cleanup(push.Close)
	up := forwardtest.NewUpstream(t, reply)
	e := newGatewayEnvFull(t, map[string]any{"max_tunnels_per_sandbox": 2, "activity_push": map[string]any{"url": push.URL, "interval": "50ms"}},
		map[string]any{"target": up.Addr().String()})
	forwardtest.CheckLeaks(t)
	before := forwarder.Tunnels().RefusedTunnels()[string(forward.ReasonTunnelLimit)]
	held := []*tls.Conn{e.userDial(t, upper), e.userDial(t, sandbox)}
	waitUntil(t, 10*time.Second, func() bool { return up.Accepted() == 2 }, "both tunnels to be dialed")
	var open []forward.TunnelInfo
	e.adminGet(t, "/sandbox/tunnels", &open)
	for _, ti := range open {
		if strings.EqualFold(ti.Sandbox, sandbox) && ti.Sandbox != sandbox {
			t.Errorf("open tunnel %d names sandbox %q, want %q", ti.ID, ti.Sandbox, sandbox)
		}
	}
	if a := activityOf(t, e.sandboxEnv, sandbox); a.OpenTunnels != 2 {
		t.Errorf("%s has %d open tunnels, want 2 (one per spelling)", sandbox, a.OpenTunnels)
	}

	logged := len(e.logLines(t, rejectedMsg))
	if n, err := userEnded(t, e.userDial(t, mixed), 0); n != 0 {
		t.Errorf("the third tunnel (%s) read %d bytes (err %v); want none", mixed, n, err)
	}
	waitRejections(t, string(forward.ReasonTunnelLimit), before+1)
	if l := e.waitLogLine(t, rejectedMsg, logged); l["reason"] != string(forward.ReasonTunnelLimit) ||
		!strings.Contains(fmt.Sprint(l["error"]), "sandbox "+sandbox+" has 2 tunnels open") {
		t.Errorf("log line %v, want a tunnel-limit rejection of %s", l, sandbox)
	}
	if n := up.Accepted(); n != 2 {
		t.Errorf("the target was dialed %d times, want 2: the refused tunnel must not dial", n)
	}

	for i, c := range held {
		if n, sum, err := transfer(c, 500, uint64(i+1)); err != nil || n != reply || sum != forwardtest.PatternSum(2, reply) {
			t.Errorf("held tunnel %d: %d bytes back, err %v; want the %d-byte reply", i, n, err, reply)
		}
	}
	waitIdle(t)
	if a := activityOf(t, e.sandboxEnv, sandbox); a.TotalTunnels != 2 || a.BytesToSandbox != 1000 || a.BytesFromSandbox != 2*reply {
		t.Errorf("activity of %s: %+v; want 2 tunnels, 1000 bytes to and %d from the sandbox", sandbox, a, 2*reply)
	}
	for _, other := range []string{upper, mixed} {
		if a := activityOf(t, e.sandboxEnv, other); a.TotalTunnels != 0 {
			t.Errorf("activity lists %s apart from %s: %+v", other, sandbox, a)
		}
	}
	waitUntil(t, 10*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return pushed[sandbox] == [2]int64{1000, 2 * reply}
	}, "the activity reports to carry both spellings' bytes under "+sandbox)
	mu.Lock()
	defer mu.Unlock()
	if len(pushed) != 1 {
		t.Errorf("activity reports named %v, want %s alone", pushed, sandbox)
	}
}

// A close and its refusal name a sandbox in any case and hold for every
// spelling: a close of SBX-R2 ends the tunnel a user opened as sbx-r2 and
// refuses a new one asked for as Sbx-R2 (sandbox-closed, nothing
// dialed); the answer and GET /sandbox/activity give the lowercase ID.
// An ID that is not valid even lowercased ("..", ".a") is a 400 that
// states the rule, and closes nothing.
func TestSandboxIDCaseClose(t *testing.T) {
	sandbox := uniqueSandbox("sbx-r2")
	target := tricklingUpstream(t, 1<<10, 20*time.Millisecond)
	e := newGatewayEnv(t, map[string]any{"target": target.String()})
	forwardtest.CheckLeaks(t)
	held := e.userDial(t, sandbox)
	waitUntil(t, 10*time.Second, func() bool { return activityOf(t, e.sandboxEnv, sandbox).OpenTunnels == 1 }, "the tunnel to open")

	for _, id := range []string{"..", ".", ".a", "-a", "sbx/r2", "\u212a"} {
		status, body := e.adminPost(t, http.MethodPost, "/sandbox/close", fmt.Sprintf(`{"sandbox": %q, "mode": "fail", "refuse_for": "1m"}`, id))
		var apiErr struct {
			Error string `json:"error"`
		}
		json.Unmarshal(body, &apiErr)
		if status != http.StatusBadRequest || !strings.Contains(apiErr.Error, `"sandbox": sandbox ID `) || !strings.Contains(apiErr.Error, "[a-z0-9._-]") {
			t.Errorf("close of %q: %d %s; want 400 naming the sandbox ID rule", id, status, body)
		}
	}
	if ids := idsOf(sandbox); len(ids) != 1 {
		t.Fatalf("a refused close ended the tunnel: open %v", ids)
	}

	res := e.closeTunnels(t, `{"sandbox": "`+strings.ToUpper(sandbox)+`", "mode": "fail", "refuse_for": "1m"}`)
	if res.Sandbox != sandbox || res.Count != 1 || res.RefusingUntil == nil {
		t.Errorf("close of %s: %+v; want %s's one tunnel closed and refused", strings.ToUpper(sandbox), res, sandbox)
	}
	if _, err := userEnded(t, held, 0); err == nil {
		t.Error("the closed tunnel's user saw no failure")
	}
	var act forwarder.ActivityResponse
	e.adminGet(t, "/sandbox/activity", &act)
	var refused []string
	for _, r := range act.Refusing {
		if strings.EqualFold(r.Sandbox, sandbox) {
			refused = append(refused, r.Sandbox)
		}
	}
	if len(refused) != 1 || refused[0] != sandbox {
		t.Errorf("GET /sandbox/activity refusing %v, want %s", refused, sandbox)
	}

	before := forwarder.Tunnels().RefusedTunnels()[string(forward.ReasonSandboxClosed)]
	logged := len(e.logLines(t, rejectedMsg))
	mixed := "Sbx" + strings.ToUpper(sandbox[3:])
	if n, _ := userEnded(t, e.userDial(t, mixed), 0); n != 0 {
		t.Errorf("a new tunnel to %s read %d bytes; want none", mixed, n)
	}
	waitRejections(t, string(forward.ReasonSandboxClosed), before+1)
	if l := e.waitLogLine(t, rejectedMsg, logged); l["reason"] != string(forward.ReasonSandboxClosed) ||
		!strings.Contains(fmt.Sprint(l["error"]), "sandbox "+sandbox+" was closed") {
		t.Errorf("log line %v, want a sandbox-closed rejection of %s", l, sandbox)
	}
	if a := activityOf(t, e.sandboxEnv, sandbox); a.TotalTunnels != 1 {
		t.Errorf("%s has had %d tunnels, want 1: the refused one must not open", sandbox, a.TotalTunnels)
	}
	waitIdle(t)
}

// The HTTP gateway takes the sandbox ID from a request header: one of
// dots or with a leading dot is refused (502, bad-sandbox in the log and
// the metric) before the control plane hears of it, so it never sees a
// path such as /lookup/..; an uppercase one is looked up, cached and
// proxied as its lowercase form, which {http.vars.sandbox_id} gives.
func TestSandboxIDFromHeader(t *testing.T) {
	app := startSandboxApp(t)
	var mu sync.Mutex
	var seen []string // request targets, as the control plane received them
	var answer string
	cp := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen = append(seen, r.RequestURI)
		a := answer
		mu.Unlock()
		fmt.Fprint(w, a)
	}))
	t.Cleanup(cp.Close)
	e := newTransportEnvWith(t, "{http.vars.sandbox_target}", func(cfg, _ map[string]any) map[string]any {
		route := cfg["apps"].(map[string]any)["http"].(map[string]any)["servers"].(map[string]any)["gateway"].(map[string]any)["routes"].([]any)[0].(map[string]any)
		route["handle"] = append([]any{
			map[string]any{"handler": "sandbox_lookup", "sandbox": "{http.request.header.X-Sbx}", "url": cp.URL + "/lookup/{sandbox}"},
			map[string]any{"handler": "headers", "response": map[string]any{"set": map[string]any{"X-Sandbox-Id": []string{"{http.vars.sandbox_id}"}}}},
		}, route["handle"].([]any)...)
		return map[string]any{"upstreams": []any{map[string]any{"dial": "{http.vars.sandbox_forwarder}"}}}
	}, map[string]any{"sandbox": "{http.vars.sandbox_id}"})
	mu.Lock()
	answer = fmt.Sprintf(`{"forwarder":%q,"target":%q}`, e.addr, app.addr)
	mu.Unlock()
	c := e.user(false)
	get := func(id string) (*http.Response, int64) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodGet, siteURL("www", "/echo?size=100"), nil)
		req.Header.Set("X-Sbx", id)
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		n, _ := io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp, n
	}
	m0 := e.metrics(t)
	bad := []string{"..", ".", ".a", "../admin", "-x"}
	for _, id := range bad {
		if resp, _ := get(id); resp.StatusCode != http.StatusBadGateway {
			t.Errorf("X-Sbx %q: %s, want 502", id, resp.Status)
		}
	}
	lines := e.logLines(t, "sandbox lookup failed; nothing is proxied")
	for _, id := range bad {
		found := false
		for _, l := range lines {
			if l["sandbox"] == id && l["reason"] == "bad-sandbox" && strings.Contains(fmt.Sprint(l["error"]), "the first a letter or a digit") {
				found = true
			}
		}
		if !found {
			t.Errorf("X-Sbx %q: no log line with reason bad-sandbox and the rule, in %v", id, lines)
		}
	}
	mu.Lock()
	if len(seen) != 0 {
		t.Errorf("the control plane saw %q, want no request", seen)
	}
	mu.Unlock()

	sandbox := uniqueSandbox("sbx-hdr")
	for _, id := range []string{strings.ToUpper(sandbox), sandbox} {
		resp, n := get(id)
		if resp.StatusCode != http.StatusOK || n != 100 || resp.Header.Get("X-Sandbox-Id") != sandbox {
			t.Errorf("X-Sbx %q: %s, %d bytes, sandbox_id %q; want 200, 100 bytes, %s", id, resp.Status, n, resp.Header.Get("X-Sandbox-Id"), sandbox)
		}
	}
	mu.Lock()
	if len(seen) != 1 || seen[0] != "/lookup/"+sandbox {
		t.Errorf("the control plane saw %q, want one request for /lookup/%s", seen, sandbox)
	}
	mu.Unlock()
	if a := activityOf(t, e.sandboxEnv, sandbox); a.TotalTunnels < 1 {
		t.Errorf("the forwarder has no tunnel of %s: %+v", sandbox, a)
	}
	if a := activityOf(t, e.sandboxEnv, strings.ToUpper(sandbox)); a.TotalTunnels != 0 {
		t.Errorf("the forwarder lists %s apart: %+v", strings.ToUpper(sandbox), a)
	}
	m1 := e.metrics(t)
	for result, want := range map[string]int64{"bad-sandbox": int64(len(bad)), "control-plane": 1, "cache": 1} {
		s := `caddy_ktls_gateway_lookups_total{module="http.handlers.sandbox_lookup",result="` + result + `"}`
		if got := m1[s] - m0[s]; got != want {
			t.Errorf("%s moved by %d, want %d", s, got, want)
		}
	}
}

// caddy sandbox sign takes --sandbox in any case and signs its lowercase
// form; an ID that is not valid even lowercased is refused with the rule.
func TestSandboxSignSandboxIDCase(t *testing.T) {
	dir := t.TempDir()
	key := filepath.Join(dir, "gw.key")
	pubPEM, err := runSandbox(t, nil, "keygen", "--key-out", key, "--key-id", "gw-case")
	if err != nil {
		t.Fatal(err)
	}
	keyring := filepath.Join(dir, "keyring.pem")
	if err := os.WriteFile(keyring, []byte(pubPEM), 0o644); err != nil {
		t.Fatal(err)
	}
	hexFrame, err := runSandbox(t, nil, "sign", "--key", key, "--sandbox", "SBX-Case.1", "--target", "10.0.0.1:80")
	if err != nil {
		t.Fatal(err)
	}
	out, err := runSandbox(t, strings.NewReader(hexFrame), "verify", "--keyring", keyring)
	var got cli.VerifiedClaims
	if err != nil || json.Unmarshal([]byte(out), &got) != nil || got.SandboxID != "sbx-case.1" {
		t.Errorf("verify of the frame signed for SBX-Case.1: %q, %v; want sandbox_id sbx-case.1", out, err)
	}
	for _, id := range []string{"..", ".", ".sbx", "_sbx"} {
		_, err := runSandbox(t, nil, "sign", "--key", key, "--sandbox", id, "--target", "10.0.0.1:80")
		if preamble.ReasonOf(err) != string(preamble.ReasonBadSandboxID) || !strings.Contains(err.Error(), "--sandbox: ") ||
			!strings.Contains(err.Error(), "the first a letter or a digit") {
			t.Errorf("sign --sandbox %q: %v; want a bad-sandbox-id error that gives the rule", id, err)
		}
	}
}

// A gateway module's sandbox option without a placeholder is checked at
// load: one that is no sandbox ID even lowercased does not load, with the
// rule and the fix; an uppercase one loads and names its lowercase form,
// as a placeholder's value would.
func TestSandboxOptionLiteral(t *testing.T) {
	for _, tc := range []struct {
		module string
		v      interface{ Validate() error }
	}{
		{"sandbox_proxy", &edgegateway.Proxy{Forwarder: "f:1", Sandbox: "..", Target: "10.0.0.1:1"}},
		{"sandbox transport", &edgegateway.Transport{Sandbox: ".a", Target: "10.0.0.1:1"}},
		{"sandbox_lookup", &edgegateway.LookupOptions{Sandbox: ".", URL: "http://cp/{sandbox}"}},
	} {
		err := tc.v.Validate()
		if err == nil || !strings.HasPrefix(err.Error(), tc.module+": `sandbox`: sandbox ID ") ||
			!strings.Contains(err.Error(), "the first a letter or a digit: give a sandbox ID or a placeholder such as {") {
			t.Errorf("%s with a literal dot ID: %v; want the rule and the fix", tc.module, err)
		}
	}
	for _, v := range []interface{ Validate() error }{&edgegateway.Proxy{Forwarder: "f:1", Sandbox: "{l4.tls.server_name.labels.2}", Target: "10.0.0.1:1"},
		&edgegateway.LookupOptions{Sandbox: "SBX-1", URL: "http://cp/{sandbox}"}} {
		if err := v.Validate(); err != nil && strings.Contains(err.Error(), "`sandbox`") {
			t.Errorf("%T: %v; a placeholder or an uppercase ID is no load error", v, err)
		}
	}

	sandbox := uniqueSandbox("sbx-literal")
	up := forwardtest.NewUpstream(t, 100)
	e := newGatewayEnv(t, map[string]any{"sandbox": strings.ToUpper(sandbox), "target": up.Addr().String()})
	if n, _, err := transfer(e.userDial(t, "anything"), 10, 1); err != nil || n != 100 {
		t.Fatalf("tunnel: %d bytes back, %v", n, err)
	}
	waitIdle(t)
	if a := activityOf(t, e.sandboxEnv, sandbox); a.TotalTunnels != 1 {
		t.Errorf("the literal %s opened no tunnel of %s: %+v", strings.ToUpper(sandbox), sandbox, a)
	}
}

// The layer4 sandbox_lookup takes the ID from the server name, whose case
// the user chose: SBX-L4 and sbx-l4 are one lookup (asked once, for the
// lowercase ID, then cached) and one sandbox at the forwarder.
func TestSandboxIDCaseLookupL4(t *testing.T) {
	t.Setenv("TEST_CP_TOKEN", "cp-token")
	cp := newFakeControlPlane(t)
	up := forwardtest.NewUpstream(t, 100)
	e := newGatewayEnvWith(t, map[string]any{"forwarder": "{l4.sandbox.forwarder}", "sandbox": "{l4.sandbox.id}", "target": "{l4.sandbox.target}"},
		cp.handler("sandbox_lookup", "{l4.tls.server_name.labels.2}"))
	sandbox := uniqueSandbox("sbx-l4c")
	cp.set(sandbox, e.addr, up.Addr().String())
	for i, name := range []string{strings.ToUpper(sandbox), sandbox} {
		if n, _, err := transfer(e.userDial(t, name), 10, uint64(i)); err != nil || n != 100 {
			t.Fatalf("%s: %d bytes back, %v", name, n, err)
		}
	}
	if n, upper := cp.count(sandbox), cp.count(strings.ToUpper(sandbox)); n != 1 || upper != 0 {
		t.Errorf("the control plane was asked %d times for %s and %d for %s, want once, lowercase", n, sandbox, upper, strings.ToUpper(sandbox))
	}
	waitIdle(t)
	if a := activityOf(t, e.sandboxEnv, sandbox); a.TotalTunnels != 2 {
		t.Errorf("%s has had %d tunnels, want 2 (both spellings)", sandbox, a.TotalTunnels)
	}
}
