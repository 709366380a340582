package caddyktls

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/modules/forwarder"
)

// cpRedirect is a control plane that answers every request with a 307 to
// another server, which counts what reaches it, and checks the token.
type cpRedirect struct {
	url, location string
	asked, stolen atomic.Int64
}

func newCPRedirect(t *testing.T) *cpRedirect {
	p := &cpRedirect{}
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.stolen.Add(1)
		w.Header().Set("Connection", "close")
	}))
	t.Cleanup(other.Close)
	p.location = other.URL + "/latest/meta-data"
	plane := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("X-Token") == "cp-secret" {
			p.asked.Add(1)
		}
		// No keep-alive: an idle client connection would count as a leak.
		w.Header().Set("Connection", "close")
		http.Redirect(w, r, p.location, http.StatusTemporaryRedirect)
	}))
	t.Cleanup(plane.Close)
	p.url = plane.URL + "/cp/{sandbox}"
	return p
}

// redirectError is the text a control-plane client fails with for p's
// answer to url.
func (p *cpRedirect) redirectError(url string) string {
	return fmt.Sprintf("%s answered 307 Temporary Redirect, Location %q: redirects are not followed", url, p.location)
}

// Through Caddy, each control-plane client refuses its control plane's
// redirect: the redirect's target gets nothing (not the X-Token, not the
// body), the call fails with an error naming the status and the Location,
// logged, and counted under its own label: a wake refuses the tunnel as
// wake-failed (outcome redirected), a report's attempts are redirected
// and the report dropped (its drop log line quotes the redirect), a lookup
// fails as redirect.
func TestControlPlaneRedirectsRefused(t *testing.T) {
	headers := map[string]any{"X-Token": []string{"cp-secret"}}
	t.Run("wake", func(t *testing.T) {
		p := newCPRedirect(t)
		e := newSandboxEnv(t, map[string]any{"wake": map[string]any{"url": strings.TrimSuffix(p.url, "/{sandbox}"), "timeout": "5s", "headers": headers}})
		m0 := e.metrics(t)
		rejected := len(e.logLines(t, rejectedMsg))
		c := e.dial(t, "sbx-asleep", netip.MustParseAddrPort(loopbackAddr(t)))
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		if n, err := c.Read(make([]byte, 1)); n != 0 || err == nil {
			t.Errorf("refused tunnel read %d bytes, %v", n, err)
		}
		c.Close()
		l := e.waitLogLine(t, rejectedMsg, rejected)
		if l["reason"] != "wake-failed" || !strings.Contains(fmt.Sprint(l["error"]), p.redirectError(strings.TrimSuffix(p.url, "/{sandbox}"))) {
			t.Errorf("rejection %v, want wake-failed naming the redirect", l)
		}
		checkMetricDeltas(t, m0, e.metrics(t), map[string]int64{
			`caddy_ktls_sandbox_wakes_total{outcome="redirected"}`:   1,
			`caddy_ktls_sandbox_wakes_total{outcome="wake-failed"}`:  0,
			`caddy_ktls_sandbox_rejects_total{reason="wake-failed"}`: 1,
		})
		if p.asked.Load() != 1 || p.stolen.Load() != 0 {
			t.Errorf("the control plane got %d wakes (want 1), the redirect's target %d requests (want 0)", p.asked.Load(), p.stolen.Load())
		}
	})
	t.Run("activity_push", func(t *testing.T) {
		p := newCPRedirect(t)
		url := strings.TrimSuffix(p.url, "/{sandbox}")
		e := newSandboxEnv(t, map[string]any{"activity_push": map[string]any{"url": url, "interval": "50ms", "attempts": 2,
			"backoff": "10ms", "headers": headers, "instance": "fwd-redirect"}})
		m0 := e.metrics(t)
		up := forwardtest.NewUpstream(t, 1003)
		if _, _, err := transfer(e.dial(t, uniqueSandbox("sbx-push-redirect"), up.Addr()), 1000, 7); err != nil {
			t.Fatal(err)
		}
		waitUntil(t, 10*time.Second, func() bool {
			m := e.metrics(t)
			return m[`caddy_ktls_activity_reports_total{outcome="dropped"}`]-m0[`caddy_ktls_activity_reports_total{outcome="dropped"}`] >= 1
		}, "a report to be dropped")
		m1 := e.metrics(t)
		redirected := m1[`caddy_ktls_activity_reports_total{outcome="redirected"}`] - m0[`caddy_ktls_activity_reports_total{outcome="redirected"}`]
		sent := m1[`caddy_ktls_activity_reports_total{outcome="sent"}`] - m0[`caddy_ktls_activity_reports_total{outcome="sent"}`]
		if redirected < 2 || sent != 0 || p.asked.Load() < 2 || p.stolen.Load() != 0 {
			t.Errorf("%d attempts redirected (want at least 2), %d reports sent (want 0); the control plane got %d POSTs, the redirect's target %d (want 0)",
				redirected, sent, p.asked.Load(), p.stolen.Load())
		}
		l := e.waitLogLine(t, forwarder.PushDropMsg, 0)
		if !strings.Contains(fmt.Sprint(l["last_answer"]), p.redirectError(url)) {
			t.Errorf("drop log line %v, want the redirect named as the last answer", l)
		}
	})
	t.Run("sandbox_lookup", func(t *testing.T) {
		p := newCPRedirect(t)
		lookup := map[string]any{"handler": "sandbox_lookup", "sandbox": "{l4.tls.server_name.labels.2}", "url": p.url, "headers": headers}
		e := newGatewayEnvWith(t, map[string]any{"forwarder": "{l4.sandbox.forwarder}", "sandbox": "{l4.sandbox.id}", "target": "{l4.sandbox.target}"}, lookup)
		m0 := e.metrics(t)
		if n, err := userEnded(t, e.userDial(t, "sbx-moved"), 0); n != 0 || err == nil {
			t.Errorf("redirected lookup: read %d bytes, %v", n, err)
		}
		l := e.waitLogLine(t, "sandbox lookup failed; nothing is proxied", 0)
		if l["reason"] != "redirect" || l["sandbox"] != "sbx-moved" ||
			!strings.Contains(fmt.Sprint(l["error"]), p.redirectError(strings.ReplaceAll(p.url, "{sandbox}", "sbx-moved"))) {
			t.Errorf("log line %v, want reason redirect naming the status and the Location", l)
		}
		checkMetricDeltas(t, m0, e.metrics(t), map[string]int64{
			`caddy_ktls_gateway_lookups_total{module="layer4.handlers.sandbox_lookup",result="redirect"}`: 1,
			gatewayDialsSeries("ok"): 0,
		})
		if p.asked.Load() != 1 || p.stolen.Load() != 0 {
			t.Errorf("the control plane got %d lookups (want 1), the redirect's target %d requests (want 0)", p.asked.Load(), p.stolen.Load())
		}
	})
}
