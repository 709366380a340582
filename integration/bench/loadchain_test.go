package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/integration/internal/benchjson"
)

// The counters are read from Prometheus's text format: the families asked
// for, each series under its name and labels, and nothing else (comments,
// other families, a histogram's series).
func TestParseCounters(t *testing.T) {
	text := `# HELP caddy_ktls_sandbox_rejects_total Refused sandbox tunnels by reason.
# TYPE caddy_ktls_sandbox_rejects_total counter
caddy_ktls_sandbox_rejects_total{reason="overloaded"} 3
caddy_ktls_sandbox_rejects_total{reason="bad signature"} 0
caddy_ktls_handshake_failures_total{module="layer4.handlers.ktls",reason="overloaded"} 12
caddy_ktls_handshake_duration_seconds_bucket{module="layer4.handlers.ktls",result="ok",le="0.001"} 40
process_open_fds 33
caddy_ktls_gateway_dials_total{module="layer4.handlers.sandbox_proxy",result="ok"} 1.5e+06
`
	got := parseCounters([]byte(text), []string{"caddy_ktls_sandbox_rejects_total", "caddy_ktls_handshake_failures_total", "caddy_ktls_gateway_dials_total"})
	want := map[string]float64{
		`caddy_ktls_sandbox_rejects_total{reason="overloaded"}`:                                  3,
		`caddy_ktls_sandbox_rejects_total{reason="bad signature"}`:                               0,
		`caddy_ktls_handshake_failures_total{module="layer4.handlers.ktls",reason="overloaded"}`: 12,
		`caddy_ktls_gateway_dials_total{module="layer4.handlers.sandbox_proxy",result="ok"}`:     1.5e6,
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("parsed %v, want %v", got, want)
	}
}

// A step's counter changes are the series that changed, a new series from
// 0; none without both scrapes.
func TestCounterDelta(t *testing.T) {
	before := map[string]float64{"a": 1, "b": 5}
	after := map[string]float64{"a": 1, "b": 7, "c": 2}
	if got := counterDelta(before, after); fmt.Sprint(got) != fmt.Sprint(map[string]float64{"b": 2, "c": 2}) {
		t.Errorf("delta %v, want b 2, c 2", got)
	}
	if got := counterDelta(before, before); got != nil {
		t.Errorf("no change gave %v", got)
	}
	if got := counterDelta(nil, after); got != nil {
		t.Errorf("a missing scrape gave %v", got)
	}
}

// A chain's step has each hop's CPU, memory and counter changes, the
// gateway first, and the contender's figures are their sums; a
// one-process contender's step has its figures and no hops.
func TestHopStepSums(t *testing.T) {
	pid := os.Getpid()
	chain := []loadHop{{name: "gateway", pid: pid}, {name: "forwarder", pid: pid}}
	var s benchjson.Step
	hopStep(&s, chain, []float64{0.604, 0.351}, []map[string]float64{{"x": 1}, nil}, []map[string]float64{{"x": 4}, {"y": 1}})
	if len(s.Hops) != 2 || s.Hops[0].Name != "gateway" || s.Hops[1].Name != "forwarder" {
		t.Fatalf("hops %+v, want gateway then forwarder", s.Hops)
	}
	if s.Hops[0].CPU != 0.6 || s.Hops[1].CPU != 0.35 || s.ContenderCPU != 0.96 {
		t.Errorf("cpu: hops %v and %v, contender %v; want 0.6, 0.35 and their unrounded sum 0.96", s.Hops[0].CPU, s.Hops[1].CPU, s.ContenderCPU)
	}
	if s.ContenderRSS != s.Hops[0].RSS+s.Hops[1].RSS || s.ContenderFDs != s.Hops[0].FDs+s.Hops[1].FDs || s.Hops[0].RSS == 0 || s.Hops[1].FDs == 0 {
		t.Errorf("memory: contender %d B / %d fds, hops %+v; want the hops' sums", s.ContenderRSS, s.ContenderFDs, s.Hops)
	}
	if fmt.Sprint(s.Hops[0].Counters) != "map[x:3]" || s.Hops[1].Counters != nil {
		t.Errorf("counters %v and %v, want x +3 at the gateway and none at the forwarder (no scrape before)", s.Hops[0].Counters, s.Hops[1].Counters)
	}
	var one benchjson.Step
	hopStep(&one, chain[1:], []float64{0.5}, nil, nil)
	if one.Hops != nil || one.ContenderCPU != 0.5 || one.ContenderRSS == 0 {
		t.Errorf("one process: hops %+v, cpu %v, rss %d; want no hops, 0.5, its RSS", one.Hops, one.ContenderCPU, one.ContenderRSS)
	}
	rss, fds, each := hopsBefore(chain)
	if len(each) != 2 || rss != each[0].RSS+each[1].RSS || fds != each[0].FDs+each[1].FDs {
		t.Errorf("before: %d B / %d fds, hops %+v; want their sums", rss, fds, each)
	}
	if _, _, each := hopsBefore(chain[1:]); each != nil {
		t.Errorf("before, one process: hops %+v, want none", each)
	}
}

// Through a chain, every answer the user gets is the gateway's: a failure
// the peer caused is named as the gateway's, its HTTP 502 is its answer
// for a failure behind it (class gateway, not the target's); the
// generator's deadline and wrong bytes are the generator's findings.
func TestClassifyChainErrors(t *testing.T) {
	denied := &net.OpError{Op: "remote error", Err: errors.New("tls: access denied")}
	for _, c := range []struct {
		err          error
		class, cause string
	}{
		{&callError{phaseCall, httpStatusError{502}}, benchjson.ClassGateway, "gateway: HTTP 502"},
		{&callError{phaseCall, httpStatusError{503}}, benchjson.ClassRefused, "gateway: HTTP 503"},
		{&callError{phaseConnect, denied}, benchjson.ClassRefused, "gateway: overloaded"},
		{&callError{phaseFirstRead, syscall.ECONNRESET}, benchjson.ClassReset, "gateway: reset in first-read"},
		{&callError{phaseFirstRead, io.EOF}, benchjson.ClassOther, "gateway: closed in first-read"},
		{&callError{phaseCall, context.DeadlineExceeded}, benchjson.ClassTimeout, "generator deadline"},
		{&callError{phaseCall, errWrongBytes}, benchjson.ClassCorrupt, "wrong bytes"},
	} {
		if class, cause := classifyChain(c.err); class != c.class || cause != c.cause {
			t.Errorf("%v: classified %s (%s), want %s (%s)", c.err, class, cause, c.class, c.cause)
		}
	}
}

// A step through a contender with two processes records both: each one's
// memory, and the change of its counters over the step, read from its
// admin endpoint's /metrics (a unix socket) before and after.
func TestLoadStepRecordsHops(t *testing.T) {
	forwardtest.CheckLeaks(t)
	up, err := startUpstream()
	if err != nil {
		t.Fatal(err)
	}
	defer up.close()
	var scrapes atomic.Int64
	sock := fakeAdmin(t, func() string {
		return fmt.Sprintf("# TYPE caddy_ktls_gateway_dials_total counter\ncaddy_ktls_gateway_dials_total{module=\"m\",result=\"overloaded\"} %d\ncaddy_ktls_gateway_dials_total{module=\"m\",result=\"ok\"} 7\n", 5*scrapes.Add(1))
	})
	gen := newLoadGen(true, 4, []func(context.Context) (net.Conn, error){plainDialer(up.rawAddr())}, "", nil, "", 64, 64, 5*time.Second)
	gen.hops = []loadHop{{name: "gateway", pid: os.Getpid(), admin: sock}, {name: "forwarder", pid: os.Getpid()}}
	s := gen.step(t.Context(), 100, 200*time.Millisecond, 1)
	if err := gen.close(); err != nil {
		t.Error(err)
	}
	if len(s.Hops) != 2 || s.ContenderRSS != s.Hops[0].RSS+s.Hops[1].RSS || s.Hops[0].RSS == 0 {
		t.Fatalf("hops %+v, contender RSS %d: want two hops whose RSS sums to it", s.Hops, s.ContenderRSS)
	}
	if got := fmt.Sprint(s.Hops[0].Counters); got != `map[caddy_ktls_gateway_dials_total{module="m",result="overloaded"}:5]` || s.Hops[1].Counters != nil {
		t.Errorf("counters %s and %v, want the gateway's overloaded dials +5 (one scrape to the next), none at the hop without an admin endpoint", got, s.Hops[1].Counters)
	}
}

// A chain's tunnels are its gateway's ok dials between two scrapes, over
// every module that dials; a gateway without the series (l7-l7's) or a
// missing scrape counts none.
func TestGatewayOKDials(t *testing.T) {
	ok := `caddy_ktls_gateway_dials_total{module="layer4.handlers.sandbox_proxy",result="ok"}`
	other := `caddy_ktls_gateway_dials_total{module="http.reverse_proxy.transport.sandbox",result="ok"}`
	shed := `caddy_ktls_gateway_dials_total{module="layer4.handlers.sandbox_proxy",result="overloaded"}`
	before := []map[string]float64{{ok: 10, shed: 1}, {}}
	after := []map[string]float64{{ok: 40, other: 2, shed: 9}, {}}
	if n, counted := gatewayOKDials(before, after); n != 32 || !counted {
		t.Errorf("%d tunnels (counted %v), want 30 + 2", n, counted)
	}
	if _, counted := gatewayOKDials([]map[string]float64{{}}, []map[string]float64{{"caddy_ktls_handshakes_total{}": 3}}); counted {
		t.Error("a gateway without dial counters counted tunnels")
	}
	if _, counted := gatewayOKDials([]map[string]float64{nil}, after); counted {
		t.Error("a missing scrape counted tunnels")
	}
}

// The sockets served in userspace because TCP_ULP failed are summed over
// every process of the chain; other offload outcomes are not, and a
// process missing a scrape counts none.
func TestULPFallbacks(t *testing.T) {
	ulp := `caddy_ktls_handshakes_total{module="layer4.handlers.ktls",reason="setsockopt-ulp"}`
	none := `caddy_ktls_handshakes_total{module="layer4.handlers.ktls",reason="none"}`
	before := []map[string]float64{{ulp: 1, none: 10}, {ulp: 0}, nil}
	after := []map[string]float64{{ulp: 2, none: 50}, {ulp: 10}, {ulp: 7}}
	if n := ulpFallbacks(before, after); n != 11 {
		t.Errorf("%d fallbacks, want 1 + 10 (the third process has no scrape before)", n)
	}
}

// The handshakes failed behind the gateway are summed over every process
// but the gateway, for every reason but shedding.
func TestFailedBehind(t *testing.T) {
	fail := func(reason string) string {
		return `caddy_ktls_handshake_failures_total{module="layer4.handlers.ktls",reason="` + reason + `"}`
	}
	before := []map[string]float64{{fail("closed"): 0}, {fail("timeout"): 2, fail("overloaded"): 5}}
	after := []map[string]float64{
		{fail("closed"): 40}, // the gateway's own users: no tunnel of its
		{fail("timeout"): 9, fail("closed"): 3, fail("other"): 1, fail("overloaded"): 80},
	}
	if n := failedBehind(before, after); n != 7+3+1 {
		t.Errorf("%d failed behind, want 7 timeouts + 3 closed + 1 other (not the gateway's, not the sheds)", n)
	}
	if n := failedBehind(before[:1], after[:1]); n != 0 {
		t.Errorf("a gateway alone: %d failed behind, want 0", n)
	}
}

// The run of 2026-12-07 on 555f7c2 (l7-l4 per call, past capacity): the
// gateway counted 675 tunnels, the kernel 1,219 installs each way, 119
// sockets served in userspace after TCP_ULP failed, and the check failed
// 12 short. That run kept no per-shape counters; the runs since counted up
// to 37 forwarder handshakes per shape ending in a timeout or a close.
// 12 failed behind make up the 12 installs; 11 leave it one short.
func TestKeyInstallCountsFailedBehind(t *testing.T) {
	c, _ := findContender("l7-l4")
	for _, tc := range []struct {
		failedBehind int64
		errors       int
	}{{12, 0}, {11, 2}} {
		r := &result{TLSStat: map[string]int64{"TlsTxSw": 1219, "TlsRxSw": 1219}, UpstreamConns: 675, keyless: 119 + tc.failedBehind}
		offloadOf(r, c)
		if len(r.Errors) != tc.errors {
			t.Errorf("%d failed behind: errors %v, want %d", tc.failedBehind, r.Errors, tc.errors)
		}
	}
}

// A chain's userspace fallbacks make up for the key installs they lack,
// and no more: l4-l4 per-call in the VM, 217 tunnels, 647 installs each
// way and 4 sockets whose TCP_ULP failed, passes; with 3 it does not.
func TestKeyInstallCountsULPFallbacks(t *testing.T) {
	c, _ := findContender("l4-l4")
	r := &result{TLSStat: map[string]int64{"TlsTxSw": 647, "TlsRxSw": 647}, UpstreamConns: 217, keyless: 4}
	offloadOf(r, c)
	if len(r.Errors) != 0 {
		t.Errorf("errors %v, want none", r.Errors)
	}
	r = &result{TLSStat: map[string]int64{"TlsTxSw": 647, "TlsRxSw": 647}, UpstreamConns: 217, keyless: 3}
	offloadOf(r, c)
	if len(r.Errors) != 2 {
		t.Errorf("errors %v, want TX and RX short of 651", r.Errors)
	}
}

// A chain settles only once its counters stop moving, however idle its
// CPU: a tunnel its gateway counts late belongs to the shape that opened
// it, not to the next one's tallies.
func TestSettleWaitsForCounters(t *testing.T) {
	var scrapes atomic.Int64
	sock := fakeAdmin(t, func() string {
		return fmt.Sprintf("caddy_ktls_gateway_dials_total{module=\"m\",result=\"ok\"} %d\n", min(scrapes.Add(1), 4))
	})
	// An idle process stands for both hops.
	idle := exec.Command("sleep", "60")
	if err := idle.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { idle.Process.Kill(); idle.Wait() }()
	hops := []loadHop{{name: "gateway", pid: idle.Process.Pid, admin: sock}, {name: "forwarder", pid: idle.Process.Pid}}
	settleHops(t.Context(), hops, time.Minute)
	// Scrapes 1–2, 3–4 differ (1→2, 3→4); 5–6 read 4 and 4.
	if n := scrapes.Load(); n != 6 {
		t.Errorf("settled after %d scrapes, want 6: the first pair of equal ones", n)
	}
	scrapes.Store(10)
	settleHops(t.Context(), hops, time.Minute)
	if n := scrapes.Load(); n != 12 {
		t.Errorf("a settled chain took %d scrapes, want 2", n-10)
	}
}

// fakeAdmin serves, for the test, an admin endpoint on a unix socket whose
// every response is body's, and returns the socket's path.
func fakeAdmin(t *testing.T, body func() string) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "admin.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, body()) })}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return sock
}

// The run of 2026-12-08 on 346a827 (l7-l4, reduced load-gateway run): in
// the reuse shape the gateway completed 247 handshakes with the forwarder
// and counted 215 dials ok, the rest left idle in its pool by the HTTP
// transport; in the per-call shape after it, 396 handshakes and 398 ok
// dials, two of them tunnels of the reuse shape first used or closed
// then. Checked against its ok dials, the per-call shape failed 4 installs
// short (743 each way and 49 sockets whose TCP_ULP failed, for 2 × 398);
// the check counts the tunnels it handshaked, and the reuse shape's
// surplus stays its own.
func TestChainTunnelsCountHandshakes(t *testing.T) {
	const m = `module="http.reverse_proxy.transport.sandbox"`
	ok := `caddy_ktls_gateway_dials_total{` + m + `,result="ok"}`
	shed := `caddy_ktls_gateway_dials_total{` + m + `,result="overloaded"}`
	done := `caddy_ktls_handshakes_total{` + m + `,reason="none"}`
	failed := `caddy_ktls_handshakes_total{` + m + `,reason="handshake-failed"}`
	user := `caddy_ktls_handshakes_total{module="layer4.handlers.ktls",reason="none"}` // another module's, not a dial
	c, _ := findContender("l7-l4")
	for _, tc := range []struct {
		name                  string
		before, after         map[string]float64
		installs, keyless     int64
		wantDials, wantCheckd int64
	}{
		{"reuse", map[string]float64{}, map[string]float64{ok: 215, done: 247, user: 500}, 488, 6, 215, 215},
		{"per-call", map[string]float64{ok: 215, done: 247, user: 500},
			map[string]float64{ok: 613, shed: 9, done: 643, failed: 9, user: 3000}, 743, 49, 398, 396},
	} {
		dials, checked, counted := chainTunnels([]map[string]float64{tc.before, {}}, []map[string]float64{tc.after, {}})
		if !counted || dials != tc.wantDials || checked != tc.wantCheckd {
			t.Errorf("%s: %d dials, %d checked (counted %v), want %d and %d", tc.name, dials, checked, counted, tc.wantDials, tc.wantCheckd)
		}
		r := &result{TLSStat: map[string]int64{"TlsTxSw": tc.installs, "TlsRxSw": tc.installs}, UpstreamConns: checked, keyless: tc.keyless}
		offloadOf(r, c)
		if len(r.Errors) != 0 {
			t.Errorf("%s: errors %v, want none", tc.name, r.Errors)
		}
	}
	// A tunnel the gateway handshaked and never counted ok is still checked:
	// one install short of 2 × 396 fails.
	r := &result{TLSStat: map[string]int64{"TlsTxSw": 742, "TlsRxSw": 742}, UpstreamConns: 396, keyless: 49}
	offloadOf(r, c)
	if len(r.Errors) != 2 {
		t.Errorf("errors %v, want TX and RX one short", r.Errors)
	}
	if _, _, counted := chainTunnels([]map[string]float64{{}}, []map[string]float64{{user: 3}}); counted {
		t.Error("a gateway without dial counters counted tunnels")
	}
}
