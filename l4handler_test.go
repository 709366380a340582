package caddyktls

import (
	"net"
	"testing"

	_ "github.com/caddyserver/caddy/v2/modules/standard"
	_ "github.com/mholt/caddy-l4"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/caddymetrics"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/internal/offload"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// closesMetric gathers caddy_ktls_connections_closed_total through a
// registry, as Prometheus scrapes it, keyed by "module event".
func closesMetric(t *testing.T) map[string]float64 {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	if err := reg.Register(caddymetrics.All); err != nil {
		t.Fatal(err)
	}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, f := range families {
		if f.GetName() != "caddy_ktls_connections_closed_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			var module, event string
			for _, l := range m.GetLabel() {
				switch l.GetName() {
				case "module":
					module = l.GetValue()
				case "event":
					event = l.GetValue()
				}
			}
			out[module+" "+event] = m.GetCounter().GetValue()
		}
	}
	return out
}

// A connection the ktls engine closes for a KeyUpdate storm (or a peer
// alert, or a failure after TLS_TX) is logged at WARN with the peer and
// counted per module in caddy_ktls_connections_closed_total; every series
// exists from the start. The events come in through the modules' observers,
// the path the engine reports them on (a real storm needs a kTLS kernel:
// TestKernelKeyUpdateFlood).
func TestConnectionCloseEventsCounted(t *testing.T) {
	before := closesMetric(t)
	for _, m := range moduleid.Engine {
		for _, ev := range offload.CloseEvents {
			if _, ok := before[m+" "+string(ev)]; !ok {
				t.Errorf("no series for %s %s before any close", m, ev)
			}
		}
	}
	peer := &net.TCPAddr{IP: net.IPv4(192, 0, 2, 7), Port: 40000}
	core, logs := observer.New(zapcore.DebugLevel)
	h := &KTLSHandler{logger: zap.New(core)}
	lw := &ListenerWrapper{logger: zap.New(core)}
	for _, observe := range []func(ktls.Event){h.observe, lw.observe} {
		observe(ktls.Event{Kind: ktls.EventRateLimited, Remote: peer, Err: ktls.ErrKeyUpdateRateLimited})
		observe(ktls.Event{Kind: ktls.EventRateLimited, Remote: peer, Err: ktls.ErrKeyUpdateRateLimited})
		observe(ktls.Event{Kind: ktls.EventKeyUpdate, Remote: peer}) // applied: not a close
	}
	h.observe(ktls.Event{Kind: ktls.EventAlert, Remote: peer, Err: ktls.AlertError(20)})
	lw.observe(ktls.Event{Kind: ktls.EventRekeyUnsupported, Remote: peer, Err: ktls.ErrRekeyUnsupported})

	after := closesMetric(t)
	for key, want := range map[string]float64{
		moduleid.L4Handler + " rate-limited":            2,
		moduleid.ListenerWrapper + " rate-limited":      2,
		moduleid.L4Handler + " alert":                   1,
		moduleid.ListenerWrapper + " alert":             0,
		moduleid.L4Handler + " closed-after-tx":         0,
		moduleid.ListenerWrapper + " rekey-unsupported": 1,
		moduleid.L4Handler + " rekey-unsupported":       0,
	} {
		if got := after[key] - before[key]; got != want {
			t.Errorf("%s: counted %v, want %v", key, got, want)
		}
	}
	if len(after) != len(moduleid.Engine)*len(offload.CloseEvents)+1 {
		t.Errorf("series %v, want exactly the engine's modules x close events, and bad-record for layer4", after)
	}
	if _, ok := before[moduleid.L4Handler+" "+string(offload.EventBadRecord)]; !ok {
		t.Errorf("no layer4 bad-record series before any close")
	}
	warned := 0
	for _, e := range logs.FilterLevelExact(zapcore.WarnLevel).All() {
		fields := e.ContextMap()
		if fields["event"] == string(ktls.EventRateLimited) {
			warned++
			if fields["remote"] != peer.String() {
				t.Errorf("rate-limit WARN without the peer: %v", fields)
			}
		}
	}
	if warned != 4 {
		t.Errorf("%d rate-limit WARN lines, want 4 (2 per module)", warned)
	}
}

// TestHandshakeEventReachesObserver: the layer4 handler's engine reports
// each handshake to the module's observer (where close events are counted
// too): one DEBUG "kernel TLS handshake" line per connection, naming its
// peer and, as the engine saw them, where its records go. On this host the
// session stays in userspace TLS, the one event a host can produce.
func TestHandshakeEventReachesObserver(t *testing.T) { handshakeEventReachesObserver(t, false) }

// TestKernelHandshakeEventReachesObserver is the same on a kTLS kernel:
// both directions in the kernel.
func TestKernelHandshakeEventReachesObserver(t *testing.T) {
	kerneltest.Require(t)
	handshakeEventReachesObserver(t, true)
}

func handshakeEventReachesObserver(t *testing.T, kernel bool) {
	const size = 1000
	up := forwardtest.NewUpstream(t, size)
	e := newSandboxConfig(t, nil)
	e.cfg["logging"].(map[string]any)["logs"].(map[string]any)["default"].(map[string]any)["level"] = "DEBUG"
	e.start(t)
	c := e.dial(t, "sbx-observed", up.Addr())
	local := c.LocalAddr().String()
	if n, sum, err := transfer(c, size, 1); err != nil || n != size || sum != forwardtest.PatternSum(2, size) {
		t.Fatalf("tunnel: received %d of %d bytes (hash ok: %v), err %v", n, size, sum == forwardtest.PatternSum(2, size), err)
	}
	want := map[string]any{"logger": "layer4.handlers.ktls", "remote": local, "version": "TLS 1.3",
		"tx": "userspace", "rx": "userspace", "reason": string(ktls.ReasonNoKernelSupport), "rx_no_pad": false}
	if kernel {
		want["tx"], want["rx"], want["reason"] = "sw", "sw", string(ktls.ReasonNone)
	}
	var got []map[string]any
	for _, l := range e.logLines(t, "kernel TLS handshake") {
		if l["remote"] == local {
			got = append(got, l)
		}
	}
	if len(got) != 1 {
		t.Fatalf("%d handshake log lines for %s, want 1: %v", len(got), local, got)
	}
	for k, v := range want {
		if got[0][k] != v {
			t.Errorf("handshake log line %v: %s = %v, want %v", got[0], k, got[0][k], v)
		}
	}
}
