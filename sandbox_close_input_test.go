package caddyktls

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward"
	"github.com/ktlsingress/caddy-ktls/modules/forwarder"
)

// adminRequest sends method path to the env's admin endpoint with
// contentType (none when empty) and body; a negative length sends the body
// chunked, without Content-Length. It returns the status and the answer's
// "error".
func (e *sandboxEnv) adminRequest(t testing.TB, method, path, contentType string, body io.Reader, length int64) (int, string) {
	t.Helper()
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	req, err := http.NewRequest(method, "http://"+e.adminAddr+path, body)
	if err != nil {
		t.Fatal(err)
	}
	req.ContentLength = length
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var apiErr struct {
		Error string `json:"error"`
	}
	json.Unmarshal(b, &apiErr)
	return resp.StatusCode, apiErr.Error
}

// rawAdminRequest writes request, whole, to the env's admin endpoint on a
// connection of its own, and reads the answer while it writes. It returns
// the status, the answer's "error", and how the connection ended after the
// answer: nil for the server's FIN, the read's error otherwise.
func (e *sandboxEnv) rawAdminRequest(t testing.TB, request string) (int, string, error) {
	t.Helper()
	c, err := net.Dial("tcp", e.adminAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(20 * time.Second))
	wrote := make(chan error, 1)
	go func() { _, err := io.WriteString(c, request); wrote <- err }()
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("reading the answer: %v (the write: %v)", err, <-wrote)
	}
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading the answer's body: %v", err)
	}
	var apiErr struct {
		Error string `json:"error"`
	}
	json.Unmarshal(b, &apiErr)
	_, end := br.ReadByte()
	if errors.Is(end, io.EOF) {
		end = nil
	}
	if err := <-wrote; err != nil && end == nil {
		t.Errorf("the server ended with a FIN, yet writing the request failed: %v", err)
	}
	return resp.StatusCode, apiErr.Error, end
}

// Every admin route of the module reads the body it did not want before
// it answers, so that a client that sends its request whole reads the
// answer: closing a socket with bytes unread would send a reset, and a
// client still writing loses the answer to its write's error. Each case
// asks for the connection's close, which net/http takes as leave to skip
// the body; the server's FIN after the answer shows that it read
// everything.
func TestAdminRefusalsReadTheBody(t *testing.T) {
	e, sb, c, _ := movingTunnel(t, "sbx-close-drain")
	big := `{"sandbox": "` + sb + `", "mode": "fail"}` + strings.Repeat(" ", 64<<10)
	chunk := func(s string) string { return fmt.Sprintf("%x\r\n%s\r\n0\r\n\r\n", len(s), s) }
	head := func(method, path string) string {
		return method + " " + path + " HTTP/1.1\r\nHost: " + e.adminAddr + "\r\nConnection: close\r\n"
	}
	length := "Content-Length: " + fmt.Sprint(len(big)) + "\r\n\r\n" + big
	cases := []struct {
		name, request string
		status        int
		error         string // the answer's error begins so
	}{
		{"close over the limit", head("POST", "/sandbox/close") + "Content-Type: application/json\r\n" + length,
			http.StatusRequestEntityTooLarge, "POST /sandbox/close: "},
		{"close over the limit, chunked", head("POST", "/sandbox/close") + "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk(big),
			http.StatusRequestEntityTooLarge, "POST /sandbox/close: "},
		{"close as text/plain", head("POST", "/sandbox/close") + "Content-Type: text/plain\r\n" + length,
			http.StatusUnsupportedMediaType, "POST /sandbox/close: "},
		{"POST /sandbox/tunnels", head("POST", "/sandbox/tunnels") + "Content-Type: application/json\r\n" + length,
			http.StatusMethodNotAllowed, "method not allowed: use GET"},
		{"PUT /sandbox/activity", head("PUT", "/sandbox/activity") + "Content-Type: application/json\r\n" + length,
			http.StatusMethodNotAllowed, "method not allowed: use GET"},
		{"GET /sandbox/upgrade", head("GET", "/sandbox/upgrade") + "Content-Type: application/json\r\n" + length,
			http.StatusMethodNotAllowed, "method not allowed: use POST"},
		{"upgrade without sandbox_handoff", head("POST", "/sandbox/upgrade") + "Content-Type: application/json\r\n" + length,
			http.StatusConflict, "no sandbox_handoff app in the running configuration"},
	}
	for _, tc := range cases {
		status, msg, end := e.rawAdminRequest(t, tc.request)
		if status != tc.status || !strings.HasPrefix(msg, tc.error) {
			t.Errorf("%s: %d %q, want %d and %q", tc.name, status, msg, tc.status, tc.error)
		}
		if end != nil {
			t.Errorf("%s: after the answer the connection ended with %v, want the server's FIN: it closed with the body unread", tc.name, end)
		}
	}
	if len(idsOf(sb)) != 1 {
		t.Errorf("a refused request ended the tunnel: %v", idsOf(sb))
	}
	c.Close()
	waitIdle(t)
}

// POST /sandbox/close refuses what it cannot read for sure, ending nothing:
// a bare number for a duration (which Caddy's durations read as
// nanoseconds: "grace": 30 cut a live tunnel after 30ns) or a duration
// without a unit, a Content-Type other than JSON, a body over 64 KiB (413
// naming the limit, with or without a Content-Length), an ID outside the
// preamble's grammar. Each refusal answers its status with an error that
// says the fix, is logged with its reason and counted.
func TestSandboxCloseInput(t *testing.T) {
	e, sb, c, r := movingTunnel(t, "sbx-close-input")
	metrics0 := e.metrics(t)
	logged := len(e.logLines(t, "POST /sandbox/close refused; nothing was closed"))
	big := `{"sandbox": "` + sb + `", "mode": "fail"}` + strings.Repeat(" ", 64<<10)
	const tooLarge = "POST /sandbox/close: the body is over the limit of 65536 bytes: send one close request"
	cases := []struct {
		name, contentType, body string
		chunked                 bool
		status                  int
		reason, want            string
	}{
		{"grace a number", "application/json", `{"sandbox": "` + sb + `", "mode": "graceful", "grace": 30}`, false, http.StatusBadRequest, "bad-request",
			`POST /sandbox/close: "grace": 30 is not a duration string: give the duration with its unit, e.g. "grace": "30s"`},
		{"refuse_for a number", "application/json", `{"sandbox": "` + sb + `", "mode": "fail", "refuse_for": 60.5}`, false, http.StatusBadRequest, "bad-request",
			`POST /sandbox/close: "refuse_for": 60.5 is not a duration string: give the duration with its unit, e.g. "refuse_for": "30s"`},
		{"grace without a unit", "application/json", `{"sandbox": "` + sb + `", "mode": "graceful", "grace": "30"}`, false, http.StatusBadRequest, "bad-request",
			`POST /sandbox/close: "grace": "30" is not a duration (time: missing unit in duration "30"): give it with its unit, e.g. "30s", "1m30s" or "2h"`},
		{"text/plain", "text/plain", `{"sandbox": "` + sb + `", "mode": "fail"}`, false, http.StatusUnsupportedMediaType, "content-type",
			`POST /sandbox/close: Content-Type "text/plain": send the close request as JSON, with the header Content-Type: application/json`},
		{"no Content-Type", "", `{"sandbox": "` + sb + `", "mode": "fail"}`, false, http.StatusUnsupportedMediaType, "content-type",
			`POST /sandbox/close: Content-Type "": send the close request as JSON, with the header Content-Type: application/json`},
		{"over the limit", "application/json", big, false, http.StatusRequestEntityTooLarge, "too-large", tooLarge},
		{"over the limit, chunked", "application/json", big, true, http.StatusRequestEntityTooLarge, "too-large", tooLarge},
		{"an ID of dots", "application/json", `{"sandbox": "..", "mode": "fail"}`, false, http.StatusBadRequest, "bad-request", `POST /sandbox/close: "sandbox": `},
	}
	for _, tc := range cases {
		length := int64(len(tc.body))
		if tc.chunked {
			length = -1
		}
		status, msg := e.adminRequest(t, http.MethodPost, "/sandbox/close", tc.contentType, strings.NewReader(tc.body), length)
		exact := tc.name != "an ID of dots" // its wording is the preamble grammar's
		if status != tc.status || exact && msg != tc.want || !exact && !strings.HasPrefix(msg, tc.want) {
			t.Errorf("%s: %d %q, want %d %q", tc.name, status, msg, tc.status, tc.want)
		}
	}
	// A Content-Type with parameters is JSON all the same.
	if status, msg := e.adminRequest(t, http.MethodPost, "/sandbox/close", "application/json; charset=utf-8",
		strings.NewReader(`{"sandbox": "sbx-none", "mode": "fail"}`), -1); status != http.StatusOK {
		t.Errorf("application/json; charset=utf-8: %d %q, want 200", status, msg)
	}
	lines := e.logLines(t, "POST /sandbox/close refused; nothing was closed")[logged:]
	if len(lines) != len(cases) {
		t.Fatalf("%d refusal log lines, want %d", len(lines), len(cases))
	}
	for i, l := range lines {
		if l["level"] != "warn" || l["reason"] != cases[i].reason || l["status"] != float64(cases[i].status) ||
			!strings.HasPrefix(fmt.Sprint(l["error"]), cases[i].want) {
			t.Errorf("%s: log line %v, want a WARN with reason %s, status %d and the error", cases[i].name, l, cases[i].reason, cases[i].status)
		}
	}
	// The tunnel was not cut: not after 30 ns, not at all.
	time.Sleep(100 * time.Millisecond)
	at := r.n.Load()
	waitUntil(t, 10*time.Second, func() bool { return r.n.Load() > at }, "the tunnel to keep moving")
	if len(idsOf(sb)) != 1 {
		t.Errorf("a refused request ended the tunnel: %v", idsOf(sb))
	}
	checkMetricDeltas(t, metrics0, e.metrics(t), map[string]int64{
		`caddy_ktls_sandbox_close_refused_total{reason="bad-request"}`:   4,
		`caddy_ktls_sandbox_close_refused_total{reason="content-type"}`:  2,
		`caddy_ktls_sandbox_close_refused_total{reason="too-large"}`:     2,
		`caddy_ktls_sandbox_close_refused_total{reason="method"}`:        0,
		`caddy_ktls_sandbox_close_refused_total{reason="refusals-full"}`: 0,
		`caddy_ktls_sandbox_close_requests_total{mode="fail"}`:           1,
		"caddy_ktls_sandbox_tunnels_closed_total":                        0,
	})
	c.Close()
	waitIdle(t)
}

// At most forward.MaxRefusals sandboxes are refused at once: a close with
// refuse_for beyond them is a 429 naming the limit that ends nothing,
// logged and counted; lengthening a refusal held already passes.
func TestSandboxCloseRefusalsFull(t *testing.T) {
	e, sb, c, r := movingTunnel(t, "sbx-close-full")
	metrics0 := e.metrics(t)
	// Fill the process's refusals (the registry is process state) for a
	// short while, so that they are gone again for the tests after this.
	const fill = 2 * time.Second
	until := time.Now().Add(fill)
	var held string
	for i := range forward.MaxRefusals - len(forwarder.Tunnels().Refusals()) {
		held = fmt.Sprintf("sbx-fill-%d", i)
		if _, err := forwarder.Tunnels().Close(forward.CloseRequest{Sandbox: held, RefuseFor: fill}); err != nil {
			t.Fatal(err)
		}
	}
	defer time.Sleep(time.Until(until) + 50*time.Millisecond)
	status, msg := e.adminRequest(t, http.MethodPost, "/sandbox/close", "application/json",
		strings.NewReader(`{"sandbox": "`+sb+`", "mode": "fail", "refuse_for": "1m"}`), -1)
	want := fmt.Sprintf(`POST /sandbox/close: sandbox %s cannot be refused: 4096 sandboxes are refused already, the most at once; `+
		`a place frees when a refusal's period ends: nothing was closed; retry once a refusal has ended `+
		`(GET /sandbox/activity lists them under "refusing"), or close without "refuse_for" (the limit is 4096 sandboxes)`, sb)
	if status != http.StatusTooManyRequests || msg != want {
		t.Errorf("close beyond the refusals: %d %q, want 429 %q", status, msg, want)
	}
	if l := e.waitLogLine(t, "POST /sandbox/close refused; nothing was closed", 0); l["reason"] != "refusals-full" || l["status"] != 429.0 {
		t.Errorf("log line %v, want reason refusals-full, status 429", l)
	}
	at := r.n.Load()
	waitUntil(t, 10*time.Second, func() bool { return r.n.Load() > at }, "the tunnel to keep moving")
	if res := e.closeTunnels(t, `{"sandbox": "`+held+`", "mode": "fail", "refuse_for": "1s"}`); res.RefusingUntil == nil {
		t.Errorf("lengthening a refusal held already: %+v", res)
	}
	checkMetricDeltas(t, metrics0, e.metrics(t), map[string]int64{
		`caddy_ktls_sandbox_close_refused_total{reason="refusals-full"}`: 1,
		`caddy_ktls_sandbox_close_requests_total{mode="fail"}`:           1,
		"caddy_ktls_sandbox_tunnels_closed_total":                        0,
	})
	c.Close()
	waitIdle(t)
}
