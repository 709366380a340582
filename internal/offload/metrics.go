package offload

import (
	"sync/atomic"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/caddymetrics"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/prometheus/client_golang/prometheus"
)

var (
	// The TLS handshake and the offload (key capture and install) of each
	// connection, by module and result: ok (the handshake completed,
	// offloaded or not: caddy_ktls_handshakes_total says how) or failed
	// (kept apart: scanners and timeouts take up to handshake_timeout,
	// 10 s by default, and would swamp the latency of the real ones). A
	// loopback TLS 1.3 handshake takes about a millisecond, one across a
	// continent a few hundred: 0.5 ms to 10 s.
	handshakeDuration = caddymetrics.NewHistogramFamily(prometheus.HistogramOpts{
		Name:    "caddy_ktls_handshake_duration_seconds",
		Help:    "TLS handshakes including the kTLS offload (key install), by module and result (ok: completed, offloaded or not; failed: the handshake failed, see caddy_ktls_handshake_failures_total).",
		Buckets: []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10},
	}, []string{"module", "result"}, moduleid.Engine, []string{HandshakeResultOK, HandshakeResultFailed})
)

// The handshake_duration results.
const (
	HandshakeResultOK     = "ok"
	HandshakeResultFailed = "failed"
)

// ObserveHandshake records ev, an EventHandshake of module's engine, in
// caddy_ktls_handshake_duration_seconds and caddy_ktls_handshakes_total.
func ObserveHandshake(module string, ev ktls.Event) {
	result := HandshakeResultOK
	if ev.Offload.Reason == ktls.ReasonHandshakeFailed {
		result = HandshakeResultFailed
	}
	handshakeDuration.WithLabelValues(module, result).Observe(ev.Duration.Seconds())
	handshakeOutcomes.Add(OutcomeKey{module, ev.Offload.Reason})
}

// KernelFeatures says, by feature of caddy_ktls_kernel_support, whether the
// kernel accepted it (ktls.Probe: probed once per process, then cached).
func KernelFeatures(caps ktls.Capabilities) map[string]bool {
	var tx, rx bool
	for _, c := range caps.Ciphers {
		tx, rx = tx || c.TX, rx || c.RX
	}
	ulp := caps.ULP == nil
	return map[string]bool{"tx": ulp && tx, "rx": ulp && rx, "rekey": ulp && caps.Rekey}
}

// CloseEvents are the ktls events that end a connection.
var CloseEvents = []ktls.EventKind{ktls.EventRateLimited, ktls.EventAlert, ktls.EventClosed, ktls.EventRekeyUnsupported, ktls.EventKeyExhausted, ktls.EventRefused}

// EventBadRecord counts the tunnels that a received record failing
// authentication ended (ktls.IsBadRecord). It is not a ktls event: on the
// kernel path the splice relay, not the conn, meets the record (EBADMSG), so
// the layer4 handler counts it from the tunnel's end error; the listener
// wrapper never sees its connections' read errors and has no such series.
const EventBadRecord ktls.EventKind = "bad-record"

// The engine's families of constant metrics, read from the counts above at
// scrape time.
var (
	descOffloads = prometheus.NewDesc("caddy_ktls_handshakes_total",
		"TLS handshakes of the connections the kTLS engine serves (the ktls handler's, the ktls listener wrapper's, and the gateway modules' to forwarders), by module and offload outcome (reason): none, TX and RX in the kernel; rx-disabled, TX in the kernel and RX in userspace (rx off); handshake-failed, the handshake itself failed (see caddy_ktls_handshake_failures_total; a gateway module's, caddy_ktls_gateway_dials_total{result=\"handshake\"}); any other reason, served in userspace TLS for that reason (or refused, with fallback refuse).",
		[]string{"module", "reason"}, nil)
	descOffloadModes = prometheus.NewDesc("caddy_ktls_offload_directions_total",
		"Completed TLS handshakes of every module, by direction (tx, rx) and where that direction's records are processed (mode): sw, the kernel in software; hw, the kernel on the NIC; userspace, Go's crypto/tls (not offloaded).",
		[]string{"direction", "mode"}, nil)
	descConnCloses = prometheus.NewDesc("caddy_ktls_connections_closed_total",
		"Connections the kTLS engine ended after their handshake, by module and event: rate-limited, KeyUpdates above keyupdate_rate; alert, the peer's fatal alert; closed-after-tx, a step after installing TLS_TX failed; rekey-unsupported, a KeyUpdate on a kernel without rekey; key-exhausted, a traffic key reached key_record_limit and could not be renewed; refused, fallback refuse and the session could not be offloaded (never offloaded); bad-record (layer4 handler only), a record that failed authentication.",
		[]string{"module", "event"}, nil)
	descHandshakeFails = prometheus.NewDesc("caddy_ktls_handshake_failures_total",
		"TLS handshakes that failed, by module and reason (not-tls, no-client-certificate, untrusted-certificate, certificate-not-allowed, unknown-server-name, timeout, overloaded: shed before the handshake because max_handshakes were in progress or the scheduling delay was above max_scheduling_delay, closed, other).",
		[]string{"module", "reason"}, nil)
)

// HandshakesInProgress counts the TLS handshakes the layer4 ktls handlers
// of the process run now, from a connection's arrival at its handler to
// the end of its handshake: the count each handler's max_handshakes
// bounds, and the gauge's value.
var HandshakesInProgress atomic.Int64

var descHandshakesInProgress = prometheus.NewDesc("caddy_ktls_handshakes_in_progress",
	"TLS handshakes the layer4 ktls handlers run now, from a connection's arrival at its handler to the end of its handshake; a handler sheds a connection that arrives while its max_handshakes are in progress in the process, or more than one per CPU while the scheduling delay is above its max_scheduling_delay (caddy_ktls_handshake_failures_total{reason=\"overloaded\"}).",
	nil, nil)

var descSchedulingDelay = prometheus.NewDesc("caddy_ktls_scheduling_delay_seconds",
	"How long the process's goroutines waited, runnable, for a CPU: the 90th percentile of the Go scheduler's run-queue delay over the last window of 100 ms or more with enough samples (0: an idle process), rounded down to the runtime's histogram bucket. A ktls handler sheds a connection that arrives while it is above max_scheduling_delay and more handshakes than CPUs are in progress (caddy_ktls_handshake_failures_total{reason=\"overloaded\"}).",
	nil, nil)

var descPartialRecordRetries = prometheus.NewDesc("caddy_ktls_partial_record_retries_total",
	"Reads of a kernel TLS receive socket woken after waiting 250 ms (doubling to 4 s) with part of a record queued, to ask the kernel again: the kernel would not wake them, and only a read lets it copy a partial record out of a full receive buffer whose window has closed. A few a minute are records that arrive slowly; a tunnel that stalls without them is a bug to report.",
	nil, nil)

var descKernelSupport = prometheus.NewDesc("caddy_ktls_kernel_support",
	"What this host's kernel accepted when the process probed it at its first use (1 yes, 0 no), by feature: tx and rx (TLS_TX, TLS_RX for at least one TLS version and cipher), rekey (a TLS 1.3 KeyUpdate: a second key installed). See `caddy ktls probe`.",
	[]string{"feature"}, nil)

func init() {
	caddymetrics.Add(moduleid.Engine, &caddymetrics.Gathered{
		Descs: []*prometheus.Desc{descOffloads, descOffloadModes, descConnCloses, descPartialRecordRetries},
		Gather: func(ch chan<- prometheus.Metric) {
			for k, n := range handshakeOutcomes.Snapshot() {
				ch <- prometheus.MustNewConstMetric(descOffloads, prometheus.CounterValue, float64(n), k.Module, string(k.Reason))
			}
			ks := ktls.Stats()
			for dir, modes := range map[string]map[ktls.Mode]uint64{"tx": ks.TX, "rx": ks.RX} {
				for mode, n := range modes {
					ch <- prometheus.MustNewConstMetric(descOffloadModes, prometheus.CounterValue, float64(n), dir, mode.String())
				}
			}
			for k, n := range connCloses.Snapshot() {
				ch <- prometheus.MustNewConstMetric(descConnCloses, prometheus.CounterValue, float64(n), k.Module, string(k.Event))
			}
			ch <- prometheus.MustNewConstMetric(descPartialRecordRetries, prometheus.CounterValue, float64(ks.PartialRecordRetries))
		},
	}, handshakeDuration)
	caddymetrics.Add(moduleid.Server, &caddymetrics.Gathered{
		Descs: []*prometheus.Desc{descHandshakeFails},
		Gather: func(ch chan<- prometheus.Metric) {
			for k, n := range handshakeFails.Snapshot() {
				ch <- prometheus.MustNewConstMetric(descHandshakeFails, prometheus.CounterValue, float64(n), k.Module, k.Reason)
			}
		},
	})
	caddymetrics.Add(moduleid.Shedder, &caddymetrics.Gathered{
		Descs: []*prometheus.Desc{descHandshakesInProgress, descSchedulingDelay},
		Gather: func(ch chan<- prometheus.Metric) {
			ch <- prometheus.MustNewConstMetric(descHandshakesInProgress, prometheus.GaugeValue, float64(HandshakesInProgress.Load()))
			ch <- prometheus.MustNewConstMetric(descSchedulingDelay, prometheus.GaugeValue, SchedulingDelay.At(time.Now()).Seconds())
		},
	})
	// The kernel's answer to the probe, only where a module that uses the
	// kernel's TLS is loaded: the probe is made once, by the first of them.
	caddymetrics.AddIfLoaded(moduleid.Engine, &caddymetrics.Gathered{
		Descs: []*prometheus.Desc{descKernelSupport},
		Gather: func(ch chan<- prometheus.Metric) {
			for feature, ok := range KernelFeatures(ktls.Probe()) {
				v := 0.0
				if ok {
					v = 1
				}
				ch <- prometheus.MustNewConstMetric(descKernelSupport, prometheus.GaugeValue, v, feature)
			}
		},
	})
}
