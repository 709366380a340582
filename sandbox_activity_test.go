package caddyktls

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/ktlsingress/caddy-ktls/forward"
	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/modules/forwarder"
)

// The handler emits sandbox_tunnel_opened and sandbox_tunnel_closed Caddy
// events that an events-app subscription receives.
func TestSandboxEventsEmitted(t *testing.T) {
	const size = 50 << 10
	up := forwardtest.NewUpstream(t, size+3)
	sandbox := uniqueSandbox("sbx-events")
	e := newSandboxConfig(t, nil)
	e.recordTunnelEvents()
	e.start(t)
	forwardtest.CheckLeaks(t)
	e.exactTunnel(t, sandbox, up, size, 9)
	opened := recordedEvent(t, "sandbox_tunnel_opened", sandbox)
	closed := recordedEvent(t, "sandbox_tunnel_closed", sandbox)
	for _, ev := range []map[string]any{opened, closed} {
		if ev["target"] != up.Addr().String() || ev["id"] != opened["id"] || !strings.HasPrefix(ev["peer"].(string), "127.0.0.1:") ||
			ev["client_certificate"] != gatewaySubject || ev["key_id"] != gatewayKeyID {
			t.Errorf("event %v does not describe the tunnel (opened: %v)", ev, opened)
		}
	}
	if closed["bytes_to_sandbox"] != int64(size) || closed["bytes_from_sandbox"] != int64(size+3) {
		t.Errorf("closed event %v, want bytes_to_sandbox %d and bytes_from_sandbox %d", closed, size, size+3)
	}
	if d, ok := closed["duration"].(float64); !ok || d <= 0 {
		t.Errorf("closed event duration %v", closed["duration"])
	}
}

// activity_push configured through Caddy POSTs reports whose deltas for a
// sandbox sum to exactly the bytes its tunnels moved, one tunnel before an
// admin-API reload that changes the push interval and one after, and
// caddy_ktls_activity_reports_total counts every report delivered, those of
// the retired configuration's pusher included.
func TestSandboxActivityPush(t *testing.T) {
	sizes := []int64{forwardtest.TransferMiB(t, 8) << 20, 64 << 10}
	sandbox := uniqueSandbox("sbx-push")
	var mu sync.Mutex
	var to, from int64
	var reports int64
	push := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var rep forward.ActivityReport
		if err := json.NewDecoder(r.Body).Decode(&rep); err != nil || r.Method != http.MethodPost || rep.SentAt.IsZero() ||
			r.Header.Get("Authorization") != "Bearer s3cret" || !strings.HasPrefix(r.Header.Get("User-Agent"), "caddy-ktls/") {
			t.Errorf("activity report: %s, decode error %v, sent_at %v, Authorization %q (want the {env.…} placeholder replaced), User-Agent %q (want caddy-ktls/<version>)",
				r.Method, err, rep.SentAt, r.Header.Get("Authorization"), r.Header.Get("User-Agent"))
		}
		mu.Lock()
		reports++
		for _, d := range rep.Sandboxes {
			if d.Sandbox == sandbox {
				to += d.BytesToSandbox
				from += d.BytesFromSandbox
			}
		}
		mu.Unlock()
		// No keep-alive: an idle pusher connection would count as a leak.
		w.Header().Set("Connection", "close")
	}))
	t.Cleanup(push.Close)
	t.Setenv("KTLS_TEST_PUSH_TOKEN", "s3cret")
	pushCfg := map[string]any{"url": push.URL, "interval": "50ms",
		"headers": map[string][]string{"Authorization": {"Bearer {env.KTLS_TEST_PUSH_TOKEN}"}}}
	e := newSandboxEnv(t, map[string]any{"activity_push": pushCfg})
	forwardtest.CheckLeaks(t)
	metrics0 := e.metrics(t)
	var movedTo, movedFrom int64
	for i, size := range sizes {
		if i > 0 {
			pushCfg["interval"] = "60ms"
			e.postLoad(t)
		}
		up := forwardtest.NewUpstream(t, size+3)
		e.exactTunnel(t, sandbox, up, size, uint64(10+i))
		movedTo, movedFrom = movedTo+size, movedFrom+size+3
	}
	const sent = `caddy_ktls_activity_reports_total{outcome="sent"}`
	deadline := time.Now().Add(10 * time.Second)
	for {
		counted := e.metric(t, sent) - metrics0[sent]
		mu.Lock()
		gotTo, gotFrom, gotReports := to, from, reports
		mu.Unlock()
		if gotTo > movedTo || gotFrom > movedFrom {
			t.Fatalf("pushed deltas sum to %d/%d, more than the %d/%d bytes moved", gotTo, gotFrom, movedTo, movedFrom)
		}
		if gotTo == movedTo && gotFrom == movedFrom && counted == gotReports {
			t.Logf("%d reports", gotReports)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("pushed deltas sum to %d/%d after %d reports (%d counted as sent), want %d/%d",
				gotTo, gotFrom, gotReports, counted, movedTo, movedFrom)
		}
		time.Sleep(20 * time.Millisecond)
	}
	checkMetricDeltas(t, metrics0, e.metrics(t), map[string]int64{
		`caddy_ktls_activity_reports_total{outcome="retried"}`: 0,
		`caddy_ktls_activity_reports_total{outcome="dropped"}`: 0,
	})
	if lines := e.logLines(t, emptyPlaceholderWarning); len(lines) != 0 {
		t.Errorf("a placeholder that is set was reported empty: %v", lines)
	}
}

const emptyPlaceholderWarning = "activity_push header placeholder is empty: the header goes out without it"

// An activity_push header whose {env.…} placeholder is empty loads with a
// WARN naming the header, the placeholder and the fix.
func TestSandboxActivityPushEmptyPlaceholder(t *testing.T) {
	t.Setenv("KTLS_TEST_EMPTY_TOKEN", "")
	e := newSandboxEnv(t, map[string]any{"activity_push": map[string]any{"url": "http://127.0.0.1:1/activity", "interval": "1h",
		"headers": map[string][]string{"Authorization": {"Bearer {env.KTLS_TEST_EMPTY_TOKEN}"}}}})
	l := e.waitLogLine(t, emptyPlaceholderWarning, 0)
	if l["level"] != "warn" || l["header"] != "Authorization" || l["placeholder"] != "{env.KTLS_TEST_EMPTY_TOKEN}" ||
		!strings.Contains(fmt.Sprint(l["fix"]), "set KTLS_TEST_EMPTY_TOKEN") {
		t.Errorf("log line %v: want a WARN naming the header, the placeholder and the variable to set", l)
	}
}

// TestSandboxActivityPushDropLogged: reports a control plane refuses are
// dropped after their attempts, counted, and logged, the first at once,
// with the control plane's answer; the drops before the configuration
// unloads are logged then, none left unsaid.
func TestSandboxActivityPushDropLogged(t *testing.T) {
	var mu sync.Mutex
	posts := 0
	push := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		posts++
		mu.Unlock()
		w.Header().Set("Connection", "close")
		http.Error(w, "tenant over quota", http.StatusTooManyRequests)
	}))
	t.Cleanup(push.Close)
	e := newSandboxEnv(t, map[string]any{"activity_push": map[string]any{"url": push.URL, "interval": "50ms", "attempts": 2, "backoff": "10ms"}})
	d0 := forwarder.ActivityReports().Dropped
	up := forwardtest.NewUpstream(t, 10)
	sandbox := uniqueSandbox("sbx-drop")
	c := e.dial(t, sandbox, up.Addr())
	defer c.Close()
	line := e.waitLogLine(t, forwarder.PushDropMsg, 0)
	answer := fmt.Sprintf(`activity pusher: %s answered 429 Too Many Requests: "tenant over quota"`, push.URL)
	if line["level"] != "warn" || line["logger"] != moduleid.SandboxHandler || line["first"] != true || line["url"] != push.URL ||
		line["last_reason"] != "attempts" || line["last_attempts"] != float64(2) || line["last_answer"] != answer ||
		!strings.Contains(fmt.Sprint(line["last_report"]), "/") {
		t.Errorf("first drop line %v: want a WARN of the sandbox handler, first, the URL, 2 attempts and the answer %q", line, answer)
	}
	waitUntil(t, 10*time.Second, func() bool { return forwarder.ActivityReports().Dropped-d0 >= 2 }, "a second drop")
	c.Close()
	if err := caddy.Load([]byte(unloadConfig), true); err != nil {
		t.Fatal(err)
	}
	// Every drop counted is in a line: the first, and the rest by the
	// summary or at the stop.
	var logged int64
	for _, l := range e.logLines(t, forwarder.PushDropMsg) {
		logged += int64(l["dropped"].(float64))
	}
	if total := forwarder.ActivityReports().Dropped - d0; uint64(logged) != total || total < 2 {
		t.Errorf("%d drops logged, %d counted: want every drop counted in a line", logged, total)
	}
}
