package caddyktls

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/ktlsingress/caddy-ktls/internal/caddymetrics"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/internal/offload"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/modules/edgegateway"
)

// Every observation the modules' code can make lands in a series declared
// from zero: the handshakes and engine closes of every engine module (the
// gateway modules' included), the failed handshakes of every module that
// accepts them, the dials and ends of every gateway module, the lookups of
// every lookup module. Each moves its series by exactly one.
func TestEveryObservationLands(t *testing.T) {
	for _, m := range moduleid.Engine {
		for _, r := range ktls.Reasons() {
			before := offload.HandshakeOutcomeCounts()[offload.OutcomeKey{Module: m, Reason: r}]
			offload.ObserveHandshake(m, ktls.Event{Kind: ktls.EventHandshake, Offload: ktls.Offload{Reason: r}, Duration: time.Millisecond})
			if got := offload.HandshakeOutcomeCounts()[offload.OutcomeKey{Module: m, Reason: r}] - before; got != 1 {
				t.Errorf("caddy_ktls_handshakes_total{module=%q,reason=%q} moved by %d, want 1", m, r, got)
			}
		}
		for _, ev := range offload.CloseEvents {
			before := offload.ConnCloseCounts()[offload.CloseKey{Module: m, Event: ev}]
			offload.CountClose(m, ev)
			if got := offload.ConnCloseCounts()[offload.CloseKey{Module: m, Event: ev}] - before; got != 1 {
				t.Errorf("caddy_ktls_connections_closed_total{module=%q,event=%q} moved by %d, want 1", m, ev, got)
			}
		}
	}
	for _, m := range moduleid.Server {
		f := offload.NewHandshakeFailureLog(m, zap.NewNop())
		for _, reason := range offload.HandshakeFailureReasons {
			before := offload.HandshakeFailureCounts()[offload.FailKey{Module: m, Reason: reason}]
			offload.CountHandshakeFailure(m, reason)
			if got := offload.HandshakeFailureCounts()[offload.FailKey{Module: m, Reason: reason}] - before; got != 1 {
				t.Errorf("caddy_ktls_handshake_failures_total{module=%q,reason=%q} moved by %d, want 1", m, reason, got)
			}
		}
		before := offload.HandshakeFailureCounts()[offload.FailKey{Module: m, Reason: "closed"}]
		f.Record(ktls.Event{Kind: ktls.EventHandshake, Offload: ktls.Offload{Reason: ktls.ReasonHandshakeFailed}, Err: io.EOF})
		if got := offload.HandshakeFailureCounts()[offload.FailKey{Module: m, Reason: "closed"}] - before; got != 1 {
			t.Errorf("%s: a failed handshake (EOF) moved its closed series by %d, want 1", m, got)
		}
	}
	for _, m := range moduleid.Gateway {
		for _, r := range edgegateway.GatewayDialResults {
			edgegateway.GatewayDials.WithLabelValues(m, r).Inc()
		}
		edgegateway.GatewayResumed.WithLabelValues(m).Inc()
	}
	for _, m := range moduleid.Lookup {
		for _, r := range edgegateway.LookupResults() {
			edgegateway.GatewayLookups.WithLabelValues(m, r).Inc()
		}
	}
	// Every family the collector has says which modules move it, and every
	// module that registers metrics is in the tables.
	ch := make(chan *prometheus.Desc, 256)
	caddymetrics.All.Describe(ch)
	close(ch)
	for d := range ch {
		if len(caddymetrics.MovedBy(d)) == 0 {
			t.Errorf("%s: no module is declared to move it; no configuration would export it", d)
		}
	}
	for _, m := range []string{moduleid.ListenerWrapper, moduleid.L4Handler, moduleid.SandboxHandler, moduleid.SandboxProxy, moduleid.SandboxTransport,
		moduleid.SandboxLookupHTTP, moduleid.SandboxLookupL4} {
		if !slices.Contains(moduleid.Any, m) {
			t.Errorf("%s registers metrics but is in no table", m)
		}
	}
}

// TestMetricsPerModule runs a forwarder and a gateway as two processes of
// the real binary and carries one HTTPS request (the listener wrapper, the
// sandbox transport) and one raw TCP session (the layer4 ktls handler,
// sandbox_proxy) through them. Every module's handshakes are counted under
// its own name, exactly (fresh processes), with the offload outcome this
// kernel gives; and each process exports the families its modules can
// move, and none at zero of the modules it does not load: the gateway no
// forwarder family, the forwarder no gateway family.
func TestMetricsPerModule(t *testing.T) { metricsPerModule(t, false) }

// TestKernelMetricsPerModule is TestMetricsPerModule on kTLS: every
// handshake offloaded both ways (reason none).
func TestKernelMetricsPerModule(t *testing.T) {
	kerneltest.Require(t)
	metricsPerModule(t, true)
}

func metricsPerModule(t *testing.T, kernel bool) {
	reason := ktls.ReasonNoKernelSupport
	if kernel || kerneltest.Available() == nil {
		reason = ktls.ReasonNone
	}
	app := startSandboxApp(t)
	echo := startEcho(t)

	fwd := newSandboxConfig(t, nil)
	files := addGatewaySide(t, fwd)
	startCaddy(t, fwd, "")

	gw := startGatewayProcess(t, fwd, files, app.addr, echo, true)
	gwHTTPS, gwTCP, gwAdmin := gw.https, gw.tcp, gw.admin

	gwMetrics := func() map[string]float64 { return parseMetrics(t, adminGet(t, gwAdmin, "/metrics")) }
	fwdMetrics := func() map[string]float64 { return parseMetrics(t, adminGet(t, fwd.adminAddr, "/metrics")) }

	// Before any traffic: what each process exports.
	checkExports(t, "gateway", gwMetrics(),
		[]string{"caddy_ktls_gateway_dials_total", "caddy_ktls_gateway_relay_bytes_total", "caddy_ktls_handshakes_total",
			"caddy_ktls_http_body_writes_total", "caddy_ktls_kernel_support", "caddy_ktls_accept_retries_total"},
		[]string{moduleid.L4Handler, moduleid.ListenerWrapper, moduleid.SandboxProxy, moduleid.SandboxTransport},
		[]string{"caddy_ktls_sandbox_", "caddy_ktls_relay_", "caddy_ktls_activity_reports_total", "caddy_ktls_gateway_lookup"})
	checkExports(t, "forwarder", fwdMetrics(),
		[]string{"caddy_ktls_sandbox_tunnels_total", "caddy_ktls_sandbox_rejects_total", "caddy_ktls_relay_bytes_total", "caddy_ktls_handshakes_total",
			"caddy_ktls_kernel_support", "caddy_ktls_accept_retries_total"},
		[]string{moduleid.L4Handler},
		[]string{"caddy_ktls_gateway_", "caddy_ktls_http_body_"})

	// One HTTPS request: the user's handshake through the listener
	// wrapper, the tunnel's through the sandbox transport.
	caPool := fwd.ca.Pool
	user := &http.Client{Timeout: time.Minute, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: caPool, ServerName: "sbx-metrics.sandbox.test"},
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, network, gwHTTPS)
		},
	}}
	resp, err := user.Get("https://sbx-metrics.sandbox.test/echo?size=10")
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("HTTPS request: %s", resp.Status)
	}
	user.CloseIdleConnections()

	// One raw TCP session: the user's handshake through the layer4 ktls
	// handler, the tunnel's through sandbox_proxy.
	c, err := tls.Dial("tcp", gwTCP, &tls.Config{RootCAs: caPool, ServerName: "sbx-metrics-tcp.sandbox.test"})
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(time.Minute))
	if _, err := c.Write([]byte("ping\n")); err != nil {
		t.Fatal(err)
	}
	if b, err := io.ReadAll(io.LimitReader(c, 5)); err != nil || string(b) != "ping\n" {
		t.Fatalf("echo: %q, %v", b, err)
	}
	c.Close()

	handshakes := func(module string) string {
		return fmt.Sprintf("caddy_ktls_handshakes_total{module=%q,reason=%q}", module, reason)
	}
	durations := func(module string) string {
		return fmt.Sprintf("caddy_ktls_handshake_duration_seconds_count{module=%q,result=\"ok\"}", module)
	}
	want := map[string]map[string]float64{
		"gateway": {
			handshakes(moduleid.ListenerWrapper): 1, durations(moduleid.ListenerWrapper): 1,
			handshakes(moduleid.SandboxTransport): 1, durations(moduleid.SandboxTransport): 1,
			handshakes(moduleid.L4Handler): 1, durations(moduleid.L4Handler): 1,
			handshakes(moduleid.SandboxProxy): 1, durations(moduleid.SandboxProxy): 1,
		},
		// The two tunnels' handshakes, the transport's and sandbox_proxy's.
		"forwarder": {handshakes(moduleid.L4Handler): 2, durations(moduleid.L4Handler): 2},
	}
	scrape := map[string]func() map[string]float64{"gateway": gwMetrics, "forwarder": fwdMetrics}
	for proc, series := range want {
		var got map[string]float64
		waitUntil(t, 10*time.Second, func() bool {
			got = scrape[proc]()
			for s, v := range series {
				if got[s] != v {
					return false
				}
			}
			return true
		}, "the handshakes counted")
		for s, v := range series {
			if got[s] != v {
				t.Errorf("%s: %s = %v, want %v", proc, s, got[s], v)
			}
		}
		// No other handshake outcome moved (runCaddy's readiness probe,
		// a connect and a close, is a failed handshake of each layer4
		// listener).
		for s, v := range got {
			if strings.HasPrefix(s, "caddy_ktls_handshakes_total{") && !strings.Contains(s, `reason="handshake-failed"`) && v != 0 && series[s] == 0 {
				t.Errorf("%s: %s = %v, want 0 (every handshake is counted once, under its module)", proc, s, v)
			}
		}
	}
}

// checkExports checks one process's scrape: the families it must have,
// the modules whose handshakes it counts (exactly those), and the family
// prefixes it must not export.
func checkExports(t *testing.T, proc string, scrape map[string]float64, have, modules, absent []string) {
	t.Helper()
	families := map[string]bool{}
	engine := map[string]bool{}
	for s := range scrape {
		name, labels, _ := strings.Cut(s, "{")
		families[name] = true
		if name == "caddy_ktls_handshakes_total" {
			_, rest, _ := strings.Cut(labels, `module="`)
			m, _, _ := strings.Cut(rest, `"`)
			engine[m] = true
		}
		for _, p := range absent {
			if strings.HasPrefix(s, p) {
				t.Errorf("%s exports %s, which none of its modules moves", proc, s)
			}
		}
	}
	for _, f := range have {
		if !families[f] {
			t.Errorf("%s exports no %s", proc, f)
		}
	}
	var got []string
	for m := range engine {
		got = append(got, m)
	}
	slices.Sort(got)
	wantModules := slices.Sorted(slices.Values(modules))
	if !slices.Equal(got, wantModules) {
		t.Errorf("%s: caddy_ktls_handshakes_total has the modules %v, want %v (those loaded that serve TLS)", proc, got, wantModules)
	}
}
