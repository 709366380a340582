package caddyktls

import (
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/internal/offload"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/modules/forwarder"
)

// The duration histograms (modules/forwarder/metrics.go, internal/offload/metrics.go) and the kernel support gauge, as
// /metrics exports them.

const (
	tunnelDurationSeries = "caddy_ktls_sandbox_tunnel_duration_seconds"
	dialDurationSeries   = "caddy_ktls_sandbox_dial_duration_seconds"
	verifyDurationSeries = "caddy_ktls_sandbox_preamble_verify_duration_seconds"
)

// handshakeDurationSeries is the handshake histogram's series of module and
// result: the family and the labels, for histDelta.
func handshakeDurationSeries(module, result string) string {
	return fmt.Sprintf("caddy_ktls_handshake_duration_seconds{module=%q,result=%q}", module, result)
}

// histDelta is how much a histogram series' _count and _sum moved between
// two scrapes; series is the family, with its labels if it has any. A
// series /metrics lacks fails the test unless want is 0: a module that
// never ran in this process (the listener wrapper, in a test run alone)
// has not created its series, and has observed nothing.
func histDelta(t *testing.T, before, after map[string]float64, series string, want float64) (count, sum float64) {
	t.Helper()
	name, labels, _ := strings.Cut(series, "{")
	if labels != "" {
		labels = "{" + labels
	}
	c, s := name+"_count"+labels, name+"_sum"+labels
	if _, ok := after[c]; !ok {
		if want == 0 {
			return 0, 0
		}
		t.Fatalf("/metrics has no %s", c)
	}
	return after[c] - before[c], after[s] - before[s]
}

// TestSandboxTimingHistograms: one tunnel, held open for a while, is one
// observation in each of the tunnel, dial, preamble verification and
// (layer4 module, ok) handshake histograms, each with a plausible sum; a
// tunnel refused for its preamble's signature is a verification and a
// handshake, and neither a dial nor a tunnel.
func TestSandboxTimingHistograms(t *testing.T) { sandboxTimingHistograms(t) }

// TestKernelSandboxTimingHistograms is the same on a kTLS kernel, where the
// handshake includes installing the keys.
func TestKernelSandboxTimingHistograms(t *testing.T) {
	kerneltest.Require(t)
	sandboxTimingHistograms(t)
}

func sandboxTimingHistograms(t *testing.T) {
	const reply = 1000
	up := forwardtest.NewUpstream(t, reply)
	e := newSandboxEnv(t, nil)
	scrape := func() map[string]float64 { return parseMetrics(t, e.adminBody(t, "/metrics")) }
	hsOK := handshakeDurationSeries(moduleid.L4Handler, offload.HandshakeResultOK)
	hsFailed := handshakeDurationSeries(moduleid.L4Handler, offload.HandshakeResultFailed)
	hsWrapper := handshakeDurationSeries(moduleid.ListenerWrapper, offload.HandshakeResultOK)

	// A tunnel the gateway holds open for hold once the reply arrived (it
	// was registered before the target's first byte could reach it).
	const hold = 300 * time.Millisecond
	before := scrape()
	c := e.dial(t, uniqueSandbox("sbx-timed"), up.Addr())
	if _, err := io.ReadFull(c, make([]byte, reply)); err != nil {
		t.Fatalf("tunnel read: %v", err)
	}
	time.Sleep(hold)
	c.Close()
	// The handler observes the duration once Serve has returned.
	var after map[string]float64
	waitUntil(t, 20*time.Second, func() bool {
		after = scrape()
		n, _ := histDelta(t, before, after, tunnelDurationSeries, 1)
		return n > 0
	}, "the tunnel's duration to be observed")
	for _, h := range []struct {
		name     string
		count    float64
		min, max time.Duration // of the sum's delta
	}{
		{tunnelDurationSeries, 1, hold, time.Minute},
		{dialDurationSeries, 1, time.Nanosecond, 10 * time.Second},  // dial_timeout
		{verifyDurationSeries, 1, time.Nanosecond, 5 * time.Second}, // preamble_timeout
		{hsOK, 1, time.Nanosecond, 2 * time.Minute},                 // handshake_timeout
		{hsFailed, 0, 0, 0},
		{hsWrapper, 0, 0, 0},
	} {
		n, sum := histDelta(t, before, after, h.name, h.count)
		if n != h.count || sum < h.min.Seconds() || sum > h.max.Seconds() {
			t.Errorf("%s: _count moved by %v, _sum by %vs; want %v, and a sum in [%v, %v]", h.name, n, sum, h.count, h.min, h.max)
		} else {
			t.Logf("%s: %v observed, %.6fs", h.name, n, sum)
		}
	}

	// Refused for its signature: verified (and refused), never dialed.
	rejected := forwarder.Tunnels().RefusedTunnels()["bad-signature"]
	before = scrape()
	other := forwardtest.NewGateway(t, gatewayKeyID) // the right key ID, another key
	rc := e.rawTunnel(t, other.Frame(t, uniqueSandbox("sbx-timed"), up.Addr()), false)
	waitRejections(t, "bad-signature", rejected+1)
	io.Copy(io.Discard, rc)
	rc.Close()
	after = scrape()
	for _, h := range []struct {
		name  string
		count float64
	}{{verifyDurationSeries, 1}, {hsOK, 1}, {dialDurationSeries, 0}, {tunnelDurationSeries, 0}} {
		if n, sum := histDelta(t, before, after, h.name, h.count); n != h.count || (n > 0) != (sum > 0) {
			t.Errorf("refused tunnel: %s: _count moved by %v (_sum by %vs), want %v", h.name, n, sum, h.count)
		}
	}
}

// kernelSupport reads caddy_ktls_kernel_support from /metrics, by feature.
func kernelSupport(t *testing.T, e *sandboxEnv) map[string]float64 {
	t.Helper()
	m := parseMetrics(t, e.adminBody(t, "/metrics"))
	out := map[string]float64{}
	for _, f := range []string{"tx", "rx", "rekey"} {
		v, ok := m[fmt.Sprintf("caddy_ktls_kernel_support{feature=%q}", f)]
		if !ok {
			t.Fatalf("/metrics has no caddy_ktls_kernel_support{feature=%q}", f)
		}
		out[f] = v
	}
	return out
}

// checkKernelSupport checks that the gauge says what ktls.Probe found.
func checkKernelSupport(t *testing.T, got map[string]float64) {
	t.Helper()
	caps := ktls.Probe()
	var tx, rx bool
	for _, c := range caps.Ciphers {
		tx, rx = tx || c.TX, rx || c.RX
	}
	b := func(v bool) float64 {
		if v && caps.ULP == nil {
			return 1
		}
		return 0
	}
	want := map[string]float64{"tx": b(tx), "rx": b(rx), "rekey": b(caps.Rekey)}
	for f, v := range want {
		if got[f] != v {
			t.Errorf("caddy_ktls_kernel_support{feature=%q} = %v, ktls.Probe() says %v (%+v)", f, got[f], v, caps)
		}
	}
}

// TestKernelSupportGaugeFollowsProbe: caddy_ktls_kernel_support says what
// ktls.Probe found; on a host without kTLS, 0 for every feature.
func TestKernelSupportGaugeFollowsProbe(t *testing.T) {
	e := newSandboxEnv(t, nil)
	got := kernelSupport(t, e)
	checkKernelSupport(t, got)
	if err := kerneltest.Available(); err != nil {
		for f, v := range got {
			if v != 0 {
				t.Errorf("no kTLS here (%v), but caddy_ktls_kernel_support{feature=%q} = %v", err, f, v)
			}
		}
	}
	t.Logf("caddy_ktls_kernel_support: %v", got)
}

// TestKernelSupportGauge: on a kTLS kernel the gauge says 1 for tx and rx,
// and rekey as ktls.Probe found it (Linux 6.14 and later).
func TestKernelSupportGauge(t *testing.T) {
	kerneltest.Require(t)
	e := newSandboxEnv(t, nil)
	got := kernelSupport(t, e)
	checkKernelSupport(t, got)
	if got["tx"] != 1 || got["rx"] != 1 {
		t.Errorf("caddy_ktls_kernel_support: %v, want tx and rx 1 on a kTLS kernel", got)
	}
	t.Logf("caddy_ktls_kernel_support: %v (kernel %s)", got, ktls.Probe().Kernel)
}
