package caddyktls

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward"
	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/sockerr"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/modules/forwarder"
)

// adminPost POSTs body to path on the env's admin endpoint and returns the
// status and the answer.
func (e *sandboxEnv) adminPost(t testing.TB, method, path, body string) (int, []byte) {
	t.Helper()
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	req, err := http.NewRequest(method, "http://"+e.adminAddr+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// closeTunnels POSTs a close request and decodes its 200 answer.
func (e *sandboxEnv) closeTunnels(t testing.TB, body string) forwarder.CloseResponse {
	t.Helper()
	status, b := e.adminPost(t, http.MethodPost, "/sandbox/close", body)
	if status != http.StatusOK {
		t.Fatalf("POST /sandbox/close %s: %d %s", body, status, b)
	}
	var res forwarder.CloseResponse
	if err := json.Unmarshal(b, &res); err != nil {
		t.Fatalf("POST /sandbox/close: %s: %v", b, err)
	}
	return res
}

// tunnelReader reads a tunnel until it ends, counting the bytes.
type tunnelReader struct {
	n   atomic.Int64
	end chan error
}

func readTunnel(c net.Conn) *tunnelReader {
	r := &tunnelReader{end: make(chan error, 1)}
	go func() {
		buf := make([]byte, 16<<10)
		for {
			n, err := c.Read(buf)
			r.n.Add(int64(n))
			if err != nil {
				r.end <- sockerr.ReadError(c, err)
				return
			}
		}
	}()
	return r
}

// waitEnd waits for r's tunnel to end and checks that its gateway read a
// failure.
func (r *tunnelReader) waitFailed(t *testing.T, kernel bool, what string) {
	t.Helper()
	select {
	case err := <-r.end:
		checkGatewayEnd(t, err, kernel, false)
	case <-time.After(10 * time.Second):
		t.Fatalf("%s is still open", what)
	}
}

// idsOf returns the IDs of sandbox's open tunnels.
func idsOf(sandbox string) []uint64 {
	var ids []uint64
	for _, ti := range forwarder.Tunnels().Tunnels() {
		if ti.Sandbox == sandbox {
			ids = append(ids, ti.ID)
		}
	}
	return ids
}

// POST /sandbox/close with mode fail ends every tunnel of one sandbox at
// once as a failure (the gateway reads it so), logged and counted, while
// another sandbox's tunnel keeps moving exact bytes; refuse_for refuses new
// tunnels to the closed sandbox as sandbox-closed, across a reload, and
// admits them again once it has passed.
func TestSandboxCloseFail(t *testing.T) { sandboxCloseFail(t, false) }

// TestKernelSandboxCloseFail is TestSandboxCloseFail on a kTLS kernel,
// where the closed tunnels' gateways read internal_error and the refused
// one access_denied.
func TestKernelSandboxCloseFail(t *testing.T) {
	kerneltest.Require(t)
	sandboxCloseFail(t, true)
}

func sandboxCloseFail(t *testing.T, kernel bool) {
	target := tricklingUpstream(t, 1<<10, 20*time.Millisecond)
	up := forwardtest.NewPacedUpstream(t, 4<<10, 10*time.Millisecond)
	e := newSandboxEnv(t, nil)
	forwardtest.CheckLeaks(t)
	metrics0 := e.metrics(t)
	sbA, sbB := uniqueSandbox("sbx-close-a"), uniqueSandbox("sbx-close-b")
	a1, a2 := e.dial(t, sbA, target), e.dial(t, sbA, target)
	defer a1.Close()
	defer a2.Close()
	r1, r2 := readTunnel(a1), readTunnel(a2)
	stop := make(chan struct{})
	stopOnce := onceCloser(stop)
	t.Cleanup(stopOnce)
	bOut := pacedStream(e.dial(t, sbB, up.Addr()), 77, 4<<10, 10*time.Millisecond, stop)
	waitUntil(t, 10*time.Second, func() bool { return r1.n.Load() > 0 && r2.n.Load() > 0 && len(idsOf(sbB)) == 1 }, "both tunnels of A to move bytes and B's to open")
	wantIDs := idsOf(sbA)

	res := e.closeTunnels(t, fmt.Sprintf(`{"sandbox": %q, "mode": "fail", "refuse_for": "6s"}`, sbA))
	if res.Count != 2 || !slices.Equal(res.Tunnels, wantIDs) || res.Mode != "fail" || res.Sandbox != sbA || res.RefusingUntil == nil || res.Deadline != nil {
		t.Errorf("close answered %+v, want sandbox %s's tunnels %v ended and a refusal", res, sbA, wantIDs)
	}
	r1.waitFailed(t, kernel, "A's first tunnel")
	r2.waitFailed(t, kernel, "A's second tunnel")
	w := e.waitLogLine(t, "closed sandbox tunnels on demand", 0)
	if w["level"] != "warn" || w["sandbox"] != sbA || w["tunnels"] != 2.0 || w["mode"] != "fail" {
		t.Errorf("log line %v, want a WARN naming the sandbox and 2 tunnels", w)
	}
	waitUntil(t, 10*time.Second, func() bool { return len(e.logLines(t, "sandbox tunnel ended with an error")) >= 2 }, "both closed tunnels' ends to be logged")
	for _, l := range e.logLines(t, "sandbox tunnel ended with an error") {
		if l["sandbox"] != sbA || !strings.Contains(fmt.Sprint(l["error"]), "the tunnel was closed on demand (sandbox "+sbA+")") {
			t.Errorf("log line %v, want A's tunnel ended by the close", l)
		}
	}
	// B keeps moving.
	before := tunnelCounters()[sbB]
	waitStreaming(t, 1, map[string]forward.TunnelInfo{sbB: before}, "B's tunnel to keep moving both ways after the close")

	// The refusal holds across a reload.
	e.sandboxHandler()["preamble_timeout"] = "4s"
	e.postLoad(t)
	var act forwarder.ActivityResponse
	e.adminGet(t, "/sandbox/activity", &act)
	if i := slices.IndexFunc(act.Refusing, func(r forward.Refusal) bool { return r.Sandbox == sbA }); i < 0 || !act.Refusing[i].Until.Equal(*res.RefusingUntil) {
		t.Errorf("GET /sandbox/activity refusing %v, want %s until %v", act.Refusing, sbA, res.RefusingUntil)
	}
	rejected0 := forwarder.Tunnels().RefusedTunnels()[string(forward.ReasonSandboxClosed)]
	refusedUp := forwardtest.NewUpstream(t, 10)
	c := e.dial(t, sbA, refusedUp.Addr())
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := io.Copy(io.Discard, c); n != 0 {
		t.Errorf("a tunnel to the closed sandbox read %d bytes", n)
	} else {
		checkGatewayEnd(t, err, kernel, true)
	}
	c.Close()
	waitRejections(t, string(forward.ReasonSandboxClosed), rejected0+1)
	if n := refusedUp.Accepted(); n != 0 {
		t.Errorf("the refused tunnel's target was dialed %d times", n)
	}
	l := e.waitLogLine(t, rejectedMsg, 0)
	if l["reason"] != "sandbox-closed" || !strings.Contains(fmt.Sprint(l["error"]), "sandbox "+sbA+" was closed: new tunnels to it are refused until") {
		t.Errorf("log line %v, want a sandbox-closed rejection naming the sandbox", l)
	}

	// Once the refusal has passed, the sandbox is admitted again.
	time.Sleep(time.Until(*res.RefusingUntil))
	after := forwardtest.NewUpstream(t, 5003)
	n, sum, err := transfer(e.dial(t, sbA, after.Addr()), 5000, 78)
	if err != nil {
		t.Fatal(err)
	}
	stopOnce()
	o := <-bOut
	if o.err != nil {
		t.Errorf("B's tunnel: %v", o.err)
	}
	checkTunnelTransfer(t, after, 5000, 78, n, sum)
	up.Close()
	if checkBothWays(t, up, []streamOutcome{o}) == 0 {
		t.Error("B's bytes were not verified")
	}
	checkMetricDeltas(t, metrics0, e.metrics(t), map[string]int64{
		"caddy_ktls_sandbox_tunnels_closed_total":                   2,
		`caddy_ktls_sandbox_close_requests_total{mode="fail"}`:      1,
		`caddy_ktls_sandbox_close_requests_total{mode="graceful"}`:  0,
		`caddy_ktls_sandbox_rejects_total{reason="sandbox-closed"}`: 1,
	})
}

func onceCloser(stop chan struct{}) func() {
	var done atomic.Bool
	return func() {
		if done.CompareAndSwap(false, true) {
			close(stop)
		}
	}
}

// Mode graceful lets a sandbox's tunnels run for the grace period: one that
// finishes within it ends cleanly with every byte both ways, one still open
// at its end is ended as a failure, logged and counted.
func TestSandboxCloseGraceful(t *testing.T) {
	target := tricklingUpstream(t, 1<<10, 20*time.Millisecond)
	up := forwardtest.NewPacedUpstream(t, 4<<10, 10*time.Millisecond)
	e := newSandboxEnv(t, nil)
	forwardtest.CheckLeaks(t)
	metrics0 := e.metrics(t)
	sb := uniqueSandbox("sbx-close-grace")
	stop := make(chan struct{})
	stopOnce := onceCloser(stop)
	t.Cleanup(stopOnce)
	finishing := pacedStream(e.dial(t, sb, up.Addr()), 79, 4<<10, 10*time.Millisecond, stop)
	lingering := e.dial(t, sb, target)
	defer lingering.Close()
	r := readTunnel(lingering)
	waitUntil(t, 10*time.Second, func() bool { return r.n.Load() > 0 && len(idsOf(sb)) == 2 }, "both tunnels to open and move bytes")
	const grace = 1500 * time.Millisecond
	start := time.Now()
	res := e.closeTunnels(t, fmt.Sprintf(`{"sandbox": %q, "mode": "graceful", "grace": "1500ms"}`, sb))
	if res.Count != 2 || res.Deadline == nil || res.RefusingUntil != nil {
		t.Errorf("close answered %+v, want 2 tunnels and a deadline", res)
	}
	if l := e.waitLogLine(t, "closing sandbox tunnels on demand: those still open at the deadline end as failures", 0); l["level"] != "info" || l["tunnels"] != 2.0 {
		t.Errorf("log line %v, want an INFO with 2 tunnels", l)
	}
	// Within the grace period the finishing tunnel completes.
	time.Sleep(200 * time.Millisecond)
	stopOnce()
	o := <-finishing
	if o.err != nil || time.Since(start) >= grace {
		t.Errorf("the tunnel finishing in the grace period ended with %v after %v", o.err, time.Since(start))
	}
	select {
	case err := <-r.end:
		t.Fatalf("the lingering tunnel ended before the grace period: %v", err)
	default:
	}
	r.waitFailed(t, false, "the tunnel still open at the grace period's end")
	if d := time.Since(start); d < grace {
		t.Errorf("the lingering tunnel ended after %v, before the grace period of %v", d, grace)
	}
	w := e.waitLogLine(t, "closed tunnels still open after the close grace period", 0)
	if w["level"] != "warn" || w["tunnels"] != 1.0 || w["sandbox"] != sb {
		t.Errorf("log line %v, want a WARN with the 1 tunnel cut", w)
	}
	raw, _ := os.ReadFile(e.logFile)
	for line := range strings.Lines(string(raw)) {
		if strings.Contains(line, "closed tunnels still open after the close grace period") && strings.Count(line, `"tunnels":`) != 1 {
			t.Errorf("log line %s: want one tunnels field", line)
		}
	}
	waitIdle(t)
	up.Close()
	if checkBothWays(t, up, []streamOutcome{o}) == 0 {
		t.Error("the finishing tunnel's bytes were not verified")
	}
	checkMetricDeltas(t, metrics0, e.metrics(t), map[string]int64{
		"caddy_ktls_sandbox_tunnels_closed_total":                  1,
		`caddy_ktls_sandbox_close_requests_total{mode="graceful"}`: 1,
	})
}

// Closing by client certificate ends the tunnels that certificate opened,
// whatever their sandbox, and only those.
func TestSandboxCloseCertificate(t *testing.T) {
	target := tricklingUpstream(t, 1<<10, 20*time.Millisecond)
	e := newSandboxConfig(t, nil)
	other := e.ca.Client(t, "gateway-2")
	auth := e.route()["handle"].([]any)[0].(map[string]any)["connection_policies"].([]any)[0].(map[string]any)["client_authentication"].(map[string]any)
	loader := auth["verifiers"].([]any)[0].(map[string]any)["leaf_certs_loaders"].([]any)[0].(map[string]any)
	loader["certificates"] = append(loader["certificates"].([]string), string(other.CertPEM))
	e.start(t)
	forwardtest.CheckLeaks(t)
	sb := uniqueSandbox("sbx-close-cert")
	keptConn := e.dial(t, sb, target)
	goneConn := e.dialWith(t, e.tlsConfig(other), e.gw.Signer, sb, target)
	goneConn2 := e.dialWith(t, e.tlsConfig(other), e.gw.Signer, uniqueSandbox("sbx-close-cert"), target)
	for _, c := range []*ktls.Conn{keptConn, goneConn, goneConn2} {
		defer c.Close()
	}
	kept, gone, gone2 := readTunnel(keptConn), readTunnel(goneConn), readTunnel(goneConn2)
	waitUntil(t, 10*time.Second, func() bool { return kept.n.Load() > 0 && gone.n.Load() > 0 && gone2.n.Load() > 0 }, "all three tunnels to move bytes")
	var want []uint64
	for _, ti := range forwarder.Tunnels().Tunnels() {
		if ti.Certificate == "CN=gateway-2" {
			want = append(want, ti.ID)
		}
	}
	res := e.closeTunnels(t, `{"client_certificate": "gateway-2", "mode": "fail"}`)
	if res.Count != 2 || !slices.Equal(res.Tunnels, want) || res.ClientCertificate != "gateway-2" {
		t.Errorf("close answered %+v, want gateway-2's tunnels %v", res, want)
	}
	gone.waitFailed(t, false, "gateway-2's first tunnel")
	gone2.waitFailed(t, false, "gateway-2's second tunnel")
	at := kept.n.Load()
	waitUntil(t, 10*time.Second, func() bool { return kept.n.Load() > at }, "gateway-1's tunnel to keep moving")
	select {
	case err := <-kept.end:
		t.Fatalf("gateway-1's tunnel ended: %v", err)
	default:
	}
	// By subject, the same certificate's tunnels: none is left.
	if res := e.closeTunnels(t, `{"client_certificate": "CN=gateway-2", "mode": "fail"}`); res.Count != 0 || len(res.Tunnels) != 0 {
		t.Errorf("a second close answered %+v, want none left", res)
	}
	keptConn.Close()
	waitIdle(t)
}

// movingTunnel is a forwarder with one tunnel of a new sandbox (named
// from prefix) to a target that trickles bytes, once they move; the
// tunnel is closed and the process checked for leaks at the test's end.
func movingTunnel(t *testing.T, prefix string) (*sandboxEnv, string, *ktls.Conn, *tunnelReader) {
	t.Helper()
	target := tricklingUpstream(t, 1<<10, 20*time.Millisecond)
	e := newSandboxEnv(t, nil)
	forwardtest.CheckLeaks(t)
	sb := uniqueSandbox(prefix)
	c := e.dial(t, sb, target)
	t.Cleanup(func() { c.Close() })
	r := readTunnel(c)
	waitUntil(t, 10*time.Second, func() bool { return r.n.Load() > 0 }, "the tunnel to move bytes")
	return e, sb, c, r
}

// A close request that names nothing or both, an unknown or missing mode,
// a grace where it does not belong, bad JSON or a wrong method is refused
// with a clear error, and ends nothing.
func TestSandboxCloseBadRequests(t *testing.T) {
	e, sb, c, r := movingTunnel(t, "sbx-close-bad")
	metrics0 := e.metrics(t)
	for _, tc := range []struct {
		method, body string
		status       int
		want         string
	}{
		{http.MethodGet, ``, http.StatusMethodNotAllowed, "use POST"},
		{http.MethodPost, `{"sandbox": "` + sb, http.StatusBadRequest, "not a close request"},
		{http.MethodPost, `{"sandbox": "` + sb + `", "mode": "fail", "sandboxes": 1}`, http.StatusBadRequest, "unknown field"},
		{http.MethodPost, `{"mode": "fail"}`, http.StatusBadRequest, `name what to close: "sandbox"`},
		{http.MethodPost, `{"sandbox": "` + sb + `", "client_certificate": "gateway-1", "mode": "fail"}`, http.StatusBadRequest, "not both"},
		{http.MethodPost, `{"sandbox": "` + sb + `", "mode": "pause"}`, http.StatusBadRequest, `unknown mode "pause"`},
		{http.MethodPost, `{"sandbox": "` + sb + `"}`, http.StatusBadRequest, `no "mode"`},
		{http.MethodPost, `{"sandbox": "` + sb + `", "mode": "graceful"}`, http.StatusBadRequest, `needs "grace"`},
		{http.MethodPost, `{"sandbox": "` + sb + `", "mode": "fail", "grace": "1s"}`, http.StatusBadRequest, `"grace" is for mode "graceful"`},
		{http.MethodPost, `{"client_certificate": "gateway-1", "mode": "fail", "refuse_for": "1m"}`, http.StatusBadRequest, `"refuse_for" applies to a sandbox`},
		{http.MethodPost, `{"sandbox": "` + sb + `", "mode": "fail", "refuse_for": "-1s"}`, http.StatusBadRequest, "must not be negative"},
		{http.MethodPost, `{"sandbox": "` + sb + `", "mode": "fail"} {}`, http.StatusBadRequest, "more than one JSON value"},
	} {
		status, body := e.adminPost(t, tc.method, "/sandbox/close", tc.body)
		var apiErr struct {
			Error string `json:"error"`
		}
		if err := json.Unmarshal(body, &apiErr); status != tc.status || err != nil || !strings.Contains(apiErr.Error, tc.want) {
			t.Errorf("%s %s: %d %s, want %d with %q", tc.method, tc.body, status, body, tc.status, tc.want)
		}
	}
	at := r.n.Load()
	waitUntil(t, 10*time.Second, func() bool { return r.n.Load() > at }, "the tunnel to keep moving")
	if len(idsOf(sb)) != 1 || len(forwarder.Tunnels().Refusals()) != 0 && slices.ContainsFunc(forwarder.Tunnels().Refusals(), func(x forward.Refusal) bool { return x.Sandbox == sb }) {
		t.Errorf("a refused request ended or refused something: tunnels %v, refusing %v", idsOf(sb), forwarder.Tunnels().Refusals())
	}
	checkMetricDeltas(t, metrics0, e.metrics(t), map[string]int64{
		"caddy_ktls_sandbox_tunnels_closed_total":                  0,
		`caddy_ktls_sandbox_close_requests_total{mode="fail"}`:     0,
		`caddy_ktls_sandbox_close_requests_total{mode="graceful"}`: 0,
	})
	c.Close()
	waitIdle(t)
}
