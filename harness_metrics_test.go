package caddyktls

import (
	"fmt"
	"maps"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/modules/forwarder"
)

// What the tests count: the Prometheus metrics, the kernel's tls_stat and
// the relay's data path, the registry's tunnels and rejections.

// metric reads one series (name and labels, as /metrics writes them) from
// the admin endpoint's /metrics.
func (e *sandboxEnv) metric(t testing.TB, series string) int64 {
	t.Helper()
	v, ok := e.metrics(t)[series]
	if !ok {
		t.Fatalf("/metrics has no %s", series)
	}
	return v
}

// metrics scrapes the admin endpoint's /metrics: every series with its
// value, cut to an integer (the series the tests read are counts).
func (e *sandboxEnv) metrics(t testing.TB) map[string]int64 {
	t.Helper()
	out := map[string]int64{}
	for series, v := range parseMetrics(t, e.adminBody(t, "/metrics")) {
		out[series] = int64(v)
	}
	return out
}

// parseMetrics reads a Prometheus text exposition (/metrics) into its
// values by series: the name and labels exactly as written.
func parseMetrics(t testing.TB, body []byte) map[string]float64 {
	t.Helper()
	out := map[string]float64{}
	for line := range strings.Lines(string(body)) {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			t.Fatalf("/metrics: %q has no value", line)
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			t.Fatalf("/metrics: %q: %v", line, err)
		}
		out[line[:i]] = v
	}
	return out
}

// checkMetricDeltas checks that each series in want moved by exactly its
// value from the scrape before to the scrape after.
func checkMetricDeltas(t *testing.T, before, after, want map[string]int64) {
	t.Helper()
	for series, d := range want {
		if _, ok := after[series]; !ok {
			t.Errorf("/metrics has no %s", series)
		} else if got := after[series] - before[series]; got != d {
			t.Errorf("%s moved by %d, want %d", series, got, d)
		}
	}
}

// tunnelEndError returns the error the handler logged when sandbox's tunnel
// ended, or "" when it ended cleanly. The handler logs the end after the
// registry's count of open tunnels (waitIdle) has fallen: where a test
// wants an error, waitTunnelEndError waits for it.
func (e *sandboxEnv) tunnelEndError(t *testing.T, sandbox string) string {
	t.Helper()
	for _, l := range e.logLines(t, "sandbox tunnel ended with an error") {
		if l["sandbox"] == sandbox {
			s, _ := l["error"].(string)
			return s
		}
	}
	return ""
}

// waitTunnelEndError is tunnelEndError once the handler has logged sandbox's
// tunnel as ended with an error, or after 10 s if it does not: "" then.
// The handler counts the end's cause (the closes by event) before it logs
// it, so those counters are complete once this returns an error.
func (e *sandboxEnv) waitTunnelEndError(t *testing.T, sandbox string) string {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if s := e.tunnelEndError(t, sandbox); s != "" || time.Now().After(deadline) {
			return s
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// dataPathDelta notes tls_stat (on a kTLS kernel) and the registry's
// data-path totals, and returns a function that gives their deltas since.
func dataPathDelta(t *testing.T, kernel bool) func() (kerneltest.Stat, forward.DataPath) {
	t.Helper()
	if kernel {
		ktls.Probe() // its first call installs keys on sockets of its own: not in the delta
	}
	read := func() kerneltest.Stat {
		if !kernel {
			return kerneltest.Stat{}
		}
		s, err := kerneltest.ReadStat()
		if err != nil {
			t.Fatalf("read tls_stat: %v", err)
		}
		return s
	}
	tls0, dp0 := read(), forwarder.Tunnels().DataPath()
	return func() (kerneltest.Stat, forward.DataPath) {
		dp := forwarder.Tunnels().DataPath()
		return read().Sub(tls0), forward.DataPath{
			SpliceBytes:    dp.SpliceBytes - dp0.SpliceBytes,
			CopyBytes:      dp.CopyBytes - dp0.CopyBytes,
			ControlRecords: dp.ControlRecords - dp0.ControlRecords,
		}
	}
}

// waitRejections waits until the registry counted want refusals for reason.
func waitRejections(t testing.TB, reason string, want uint64) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for forwarder.Tunnels().RefusedTunnels()[reason] != want {
		if time.Now().After(deadline) {
			t.Fatalf("rejections[%q] = %d, want %d (every reason: %v)", reason, forwarder.Tunnels().RefusedTunnels()[reason], want, forwarder.Tunnels().RefusedTunnels())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitIdle waits until the registry has no open tunnel.
func waitIdle(t testing.TB) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		if open, _ := forwarder.Tunnels().Counts(); open == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("tunnels still open: %+v", forwarder.Tunnels().Tunnels())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// sandboxTotals is one sandbox's entry in GET /sandbox/activity.
type sandboxTotals struct {
	Sandbox          string `json:"sandbox"`
	BytesToSandbox   int64  `json:"bytes_to_sandbox"`
	BytesFromSandbox int64  `json:"bytes_from_sandbox"`
	OpenTunnels      int64  `json:"open_tunnels"`
	TotalTunnels     int64  `json:"total_tunnels"`
}

func activityOf(t testing.TB, e *sandboxEnv, sandbox string) sandboxTotals {
	t.Helper()
	var resp struct {
		Sandboxes []sandboxTotals `json:"sandboxes"`
	}
	e.adminGet(t, "/sandbox/activity", &resp)
	for _, a := range resp.Sandboxes {
		if a.Sandbox == sandbox {
			return a
		}
	}
	return sandboxTotals{Sandbox: sandbox}
}

// waitTunnel polls GET /sandbox/tunnels until sandbox's only open tunnel
// shows exactly toSandbox and fromSandbox bytes moved, and returns it.
func (e *sandboxEnv) waitTunnel(t *testing.T, sandbox string, toSandbox, fromSandbox int64) forward.TunnelInfo {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var all, mine []forward.TunnelInfo
		e.adminGet(t, "/sandbox/tunnels", &all)
		for _, ti := range all {
			if ti.Sandbox == sandbox {
				mine = append(mine, ti)
			}
		}
		if len(mine) == 1 && mine[0].BytesToSandbox == toSandbox && mine[0].BytesFromSandbox == fromSandbox {
			return mine[0]
		}
		if time.Now().After(deadline) {
			t.Fatalf("GET /sandbox/tunnels: %+v; want one tunnel of %s with %d/%d bytes", mine, sandbox, toSandbox, fromSandbox)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// dataPathCheck notes, on a kTLS kernel (kernel), tls_stat and the
// registry's data-path totals, and returns a check to call once at least
// sessions tunnels have moved their bytes and closed: it checks that the
// kernel carried TLS records both ways for every session without a
// decryption error and that no tunnel byte was copied through userspace,
// and returns the bytes spliced meanwhile. Without kernel (where tls_stat
// may not exist) the check does nothing and returns 0.
func dataPathCheck(t *testing.T, kernel bool, sessions int64) (splicedSince func() int64) {
	t.Helper()
	if !kernel {
		return func() int64 { return 0 }
	}
	dp0 := forwarder.Tunnels().DataPath()
	tls0, err := kerneltest.ReadStat()
	if err != nil {
		t.Fatalf("read tls_stat: %v", err)
	}
	return func() int64 {
		t.Helper()
		tls1, err := kerneltest.ReadStat()
		if err != nil {
			t.Fatalf("read tls_stat: %v", err)
		}
		delta, dp := tls1.Sub(tls0), forwarder.Tunnels().DataPath()
		spliced, copied := dp.SpliceBytes-dp0.SpliceBytes, dp.CopyBytes-dp0.CopyBytes
		if delta["TlsTxSw"] < sessions || delta["TlsRxSw"] < sessions || delta["TlsDecryptError"] != 0 {
			t.Errorf("tls_stat delta %v: want TlsTxSw and TlsRxSw >= %d (the kernel carried every session), TlsDecryptError 0", delta, sessions)
		}
		if spliced == 0 || copied != 0 {
			t.Errorf("data path: %d bytes spliced, %d copied; want every byte spliced", spliced, copied)
		}
		t.Logf("tls_stat delta %v; %d bytes spliced, %d copied", delta, spliced, copied)
		return spliced
	}
}

// handshakeDeltas returns how much each caddy_ktls_handshakes_total series
// moved from before to after, leaving out those that did not move.
func handshakeDeltas(before, after map[string]int64) map[string]int64 {
	out := map[string]int64{}
	for series, v := range after {
		if strings.HasPrefix(series, "caddy_ktls_handshakes_total{") && v != before[series] {
			out[series] = v - before[series]
		}
	}
	return out
}

// handshakeSeries is the layer4 ktls handler's caddy_ktls_handshakes_total
// series of reason.
func handshakeSeries(reason ktls.Reason) string {
	return fmt.Sprintf("caddy_ktls_handshakes_total{module=%q,reason=%q}", moduleid.L4Handler, reason)
}

// checkHandshakes checks that the handshakes counted since before are
// exactly want (series by reason), no other reason included.
func (e *sandboxEnv) checkHandshakes(t *testing.T, before map[string]int64, want map[ktls.Reason]int64) {
	t.Helper()
	wantSeries := map[string]int64{}
	for reason, n := range want {
		wantSeries[handshakeSeries(reason)] = n
	}
	if got := handshakeDeltas(before, e.metrics(t)); !maps.Equal(got, wantSeries) {
		t.Errorf("handshakes counted: %v, want %v", got, wantSeries)
	}
}
