package caddyktls

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"

	"github.com/ktlsingress/caddy-ktls/forward"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

// Which modules move which metrics: one table per fact. The metrics'
// series are declared from them, and a configuration's registry exports
// the families its loaded modules can move (metricsView).
var (
	// engineModules serve connections through the kTLS engine: each
	// reports every handshake (observeHandshake) and every connection the
	// engine ends (countClose).
	engineModules = []string{moduleListenerWrapper, moduleL4Handler, moduleSandboxProxy, moduleSandboxTransport}
	// serverModules accept TLS handshakes and count the failed ones by
	// reason (handshakeFailureLog). The gateway modules count theirs as
	// dials that failed at the handshake (caddy_ktls_gateway_dials_total).
	serverModules = []string{moduleListenerWrapper, moduleL4Handler}
	// forwarderModules carry sandbox tunnels (the registry, the pushers,
	// the wakes).
	forwarderModules = []string{moduleSandboxHandler}
	// gatewayModules open tunnels to forwarders.
	gatewayModules = []string{moduleSandboxProxy, moduleSandboxTransport}
	// relayModules relay a gateway's tunnels themselves (the transport
	// leaves its bytes to net/http).
	relayModules = []string{moduleSandboxProxy}
	// lookupModules ask the control plane where a sandbox is.
	lookupModules = []string{moduleSandboxLookupHTTP, moduleSandboxLookupL4}
	// anyModule: every module that registers metrics (what any of them
	// may serve, such as a tcp-retry listener).
	anyModule = slices.Concat(engineModules, forwarderModules, lookupModules)
)

// collector exposes the process-level state (tunnel registry, pushers, ktls
// counters) to Prometheus. It is created once per process and exported
// into every configuration's registry through a metricsView: Caddy makes a
// new metrics registry for each config load, while tunnels and counters
// outlive reloads, so the values are read from the process state at scrape
// time instead of being kept in per-config metric objects.
type collector struct {
	tunnelsOpen, tunnelsOpened, tunnelsExpired, tunnelsRevoked, tunnelsClosed, closeRequests, closeRefused, bytes, rejects, relayBytes, controlRecords, pipeShortages,
	pushReports, offloads, offloadModes, connCloses, handshakeFails, acceptRetries, kernelSupport, throttled *prometheus.Desc
	// The metric vectors and histograms are process-level too: observed
	// as events end, collected from here into every configuration's
	// registry.
	vecs []prometheus.Collector
	// movers says, for every family (its Desc), the modules that can move
	// it.
	movers map[*prometheus.Desc][]string
}

// familyMovers collects the movers of the families as they are made (the
// collector's movers; package initialization fills it).
var familyMovers = map[*prometheus.Desc][]string{}

// movedBy notes that the modules by move the family d and returns it.
func movedBy(by []string, d *prometheus.Desc) *prometheus.Desc {
	familyMovers[d] = by
	return d
}

// addVecs adds vectors (counters, histograms) that the modules by move to
// the collector.
func (c *collector) addVecs(by []string, vecs ...prometheus.Collector) {
	for _, v := range vecs {
		ch := make(chan *prometheus.Desc, 4)
		v.Describe(ch)
		close(ch)
		for d := range ch {
			c.movers[d] = by
		}
		c.vecs = append(c.vecs, v)
	}
}

var metrics = &collector{
	tunnelsOpen:    movedBy(forwarderModules, prometheus.NewDesc("caddy_ktls_sandbox_tunnels_active", "Sandbox tunnels open now.", nil, nil)),
	tunnelsOpened:  movedBy(forwarderModules, prometheus.NewDesc("caddy_ktls_sandbox_tunnels_total", "Sandbox tunnels opened since the process started.", nil, nil)),
	tunnelsExpired: movedBy(forwarderModules, prometheus.NewDesc("caddy_ktls_sandbox_tunnels_expired_total", "Sandbox tunnels ended for reaching max_tunnel_lifetime.", nil, nil)),
	tunnelsRevoked: movedBy(forwarderModules, prometheus.NewDesc("caddy_ktls_sandbox_tunnels_revoked_total", "Sandbox tunnels ended because a reload left their signing key trusted by no configuration.", nil, nil)),
	tunnelsClosed:  movedBy(forwarderModules, prometheus.NewDesc("caddy_ktls_sandbox_tunnels_closed_total", "Sandbox tunnels ended as failures by POST /sandbox/close (at once, or still open when its grace period ended).", nil, nil)),
	closeRequests: movedBy(forwarderModules, prometheus.NewDesc("caddy_ktls_sandbox_close_requests_total",
		"POST /sandbox/close requests served, by mode: fail (end the tunnels at once), graceful (end those still open after a grace period).", []string{"mode"}, nil)),
	closeRefused: movedBy(forwarderModules, prometheus.NewDesc("caddy_ktls_sandbox_close_refused_total",
		"POST /sandbox/close requests refused, nothing closed, by reason: method (not POST, 405), content-type (not application/json, 415), too-large (a body over 64 KiB, 413), bad-request (no valid close request, 400), refusals-full (refuse_for beyond the sandboxes refused at once, 429).", []string{"reason"}, nil)),
	bytes:   movedBy(forwarderModules, prometheus.NewDesc("caddy_ktls_sandbox_bytes_total", "Bytes relayed by sandbox tunnels, by direction (to_sandbox, from_sandbox).", []string{"direction"}, nil)),
	rejects: movedBy(forwarderModules, prometheus.NewDesc("caddy_ktls_sandbox_rejects_total", "Refused sandbox tunnels by reason.", []string{"reason"}, nil)),
	relayBytes: movedBy(forwarderModules, prometheus.NewDesc("caddy_ktls_relay_bytes_total",
		"Bytes of closed sandbox tunnels by data path: splice (socket to socket through a kernel pipe, never in userspace) or copy (through a userspace buffer: a direction in userspace TLS, or a burst without a pipe).",
		[]string{"path"}, nil)),
	controlRecords: movedBy(forwarderModules, prometheus.NewDesc("caddy_ktls_relay_control_records_total", "TLS control records (alerts, post-handshake messages such as KeyUpdate) read in userspace from kernel-TLS sockets during the relays of closed sandbox tunnels.", nil, nil)),
	pipeShortages: movedBy(forwarderModules, prometheus.NewDesc("caddy_ktls_relay_pipe_shortages_total",
		"Transfer bursts of closed tunnels copied through userspace because no pipe could be opened (the process or system out of file descriptors).", nil, nil)),
	pushReports: movedBy(forwarderModules, prometheus.NewDesc("caddy_ktls_activity_reports_total", "Activity reports by outcome (sent, retried, dropped), and the POST attempts answered with a redirect, which is not followed (redirected; each is also retried or ends in dropped).", []string{"outcome"}, nil)),
	offloads: movedBy(engineModules, prometheus.NewDesc("caddy_ktls_handshakes_total",
		"TLS handshakes of the connections the kTLS engine serves (the ktls handler's, the ktls listener wrapper's, and the gateway modules' to forwarders), by module and offload outcome (reason): none, TX and RX in the kernel; rx-disabled, TX in the kernel and RX in userspace (rx off); handshake-failed, the handshake itself failed (see caddy_ktls_handshake_failures_total; a gateway module's, caddy_ktls_gateway_dials_total{result=\"handshake\"}); any other reason, served in userspace TLS for that reason (or refused, with fallback refuse).",
		[]string{"module", "reason"}, nil)),
	offloadModes: movedBy(engineModules, prometheus.NewDesc("caddy_ktls_offload_directions_total",
		"Completed TLS handshakes of every module, by direction (tx, rx) and where that direction's records are processed (mode): sw, the kernel in software; hw, the kernel on the NIC; userspace, Go's crypto/tls (not offloaded).",
		[]string{"direction", "mode"}, nil)),
	connCloses: movedBy(engineModules, prometheus.NewDesc("caddy_ktls_connections_closed_total",
		"Connections the kTLS engine ended after their handshake, by module and event: rate-limited, KeyUpdates above keyupdate_rate; alert, the peer's fatal alert; closed-after-tx, a step after installing TLS_TX failed; rekey-unsupported, a KeyUpdate on a kernel without rekey; key-exhausted, a traffic key reached key_record_limit and could not be renewed; refused, fallback refuse and the session could not be offloaded (never offloaded); bad-record (layer4 handler only), a record that failed authentication.",
		[]string{"module", "event"}, nil)),
	handshakeFails: movedBy(serverModules, prometheus.NewDesc("caddy_ktls_handshake_failures_total",
		"TLS handshakes that failed, by module and reason (not-tls, no-client-certificate, untrusted-certificate, certificate-not-allowed, unknown-server-name, timeout, closed, other).",
		[]string{"module", "reason"}, nil)),
	acceptRetries: movedBy(anyModule, prometheus.NewDesc("caddy_ktls_accept_retries_total",
		"Accepts on tcp-retry listeners that failed for lack of file descriptors or memory and were retried.", nil, nil)),
	kernelSupport: movedBy(engineModules, prometheus.NewDesc("caddy_ktls_kernel_support",
		"What this host's kernel accepted when the process probed it at its first use (1 yes, 0 no), by feature: tx and rx (TLS_TX, TLS_RX for at least one TLS version and cipher), rekey (a TLS 1.3 KeyUpdate: a second key installed). See `caddy ktls probe`.",
		[]string{"feature"}, nil)),
	throttled: movedBy(forwarderModules, prometheus.NewDesc("caddy_ktls_sandbox_throttled_seconds_total",
		"Time the directions of closed sandbox tunnels waited for their sandbox's max_bandwidth cap, by direction (to_sandbox, from_sandbox).",
		[]string{"direction"}, nil)),
	movers: familyMovers,
}

func init() {
	metrics.addVecs(forwarderModules, tunnelDuration, dialDuration, preambleVerifyDuration)
	metrics.addVecs(engineModules, handshakeDuration)
}

// The duration histograms. Their buckets cover what each measures, from
// the usual case to the bound a timeout sets, with the +Inf bucket beyond.
var (
	// From the registration of a tunnel (its target answered) to its end.
	// Tunnels carry anything from one request (well under a second) to a
	// shell or a database session held for hours: 100 ms to 1 day, about
	// 3x apart, so that max_tunnel_lifetime (often an hour or a day) has a
	// bucket edge near it.
	tunnelDuration = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "caddy_ktls_sandbox_tunnel_duration_seconds",
		Help:    "How long sandbox tunnels lived, from their registration (the target answered) to their end; observed as each ends.",
		Buckets: []float64{0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 1800, 3600, 4 * 3600, 12 * 3600, 24 * 3600},
	})
	// The TLS handshake and the offload (key capture and install) of each
	// connection, by module and result: ok (the handshake completed,
	// offloaded or not: caddy_ktls_handshakes_total says how) or failed
	// (kept apart: scanners and timeouts take up to handshake_timeout,
	// 10 s by default, and would swamp the latency of the real ones). A
	// loopback TLS 1.3 handshake takes about a millisecond, one across a
	// continent a few hundred: 0.5 ms to 10 s.
	handshakeDuration = newHistogramFamily(prometheus.HistogramOpts{
		Name:    "caddy_ktls_handshake_duration_seconds",
		Help:    "TLS handshakes including the kTLS offload (key install), by module and result (ok: completed, offloaded or not; failed: the handshake failed, see caddy_ktls_handshake_failures_total).",
		Buckets: []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10},
	}, []string{"module", "result"}, engineModules, []string{handshakeResultOK, handshakeResultFailed})
	// The connect to a sandbox's target, successful or not. Sandbox
	// networks are local: a connect takes tens to hundreds of
	// microseconds, a slow or overloaded host milliseconds, and a failed
	// one up to dial_timeout (10 s by default): 50 µs to 10 s.
	dialDuration = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "caddy_ktls_sandbox_dial_duration_seconds",
		Help:    "Connects to sandbox targets, from the start of the dial to the connection or its failure (up to dial_timeout).",
		Buckets: []float64{0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5, 1, 2.5, 5, 10},
	})
	// The verdict on a preamble frame, accepted or refused: an Ed25519
	// verification takes some 50 µs and the checks around it a few more;
	// a loaded CPU or a contended replay cache milliseconds: 10 µs to
	// 50 ms, finer below 1 ms.
	preambleVerifyDuration = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "caddy_ktls_sandbox_preamble_verify_duration_seconds",
		Help:    "Preamble verifications (parse, key, signature, validity, channel binding, replay, key_clients), from the frame read whole to the verdict, accepted or refused.",
		Buckets: []float64{0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.01, 0.05},
	})
)

// The handshake_duration results.
const (
	handshakeResultOK     = "ok"
	handshakeResultFailed = "failed"
)

// observeHandshake records ev, an EventHandshake of module's engine, in
// caddy_ktls_handshake_duration_seconds and caddy_ktls_handshakes_total.
func observeHandshake(module string, ev ktls.Event) {
	result := handshakeResultOK
	if ev.Offload.Reason == ktls.ReasonHandshakeFailed {
		result = handshakeResultFailed
	}
	handshakeDuration.WithLabelValues(module, result).Observe(ev.Duration.Seconds())
	handshakeOutcomes.add(outcomeKey{module, ev.Offload.Reason})
}

// observeStep records a timed step of a tunnel's opening (forward.Config.OnStep).
func observeStep(s forward.Step, d time.Duration) {
	switch s {
	case forward.StepPreambleVerify:
		preambleVerifyDuration.Observe(d.Seconds())
	case forward.StepDial:
		dialDuration.Observe(d.Seconds())
	}
}

// The wakes of sandboxes whose target did not answer (the sandbox
// handler's wake option), by outcome, and how long each took: a paused
// sandbox resumes in a second or a few (Kata: 2-5 s), a failed wake ends
// at the request timeout, a silent target at the wake timeout (30 s by
// default): 50 ms to 60 s.
var (
	sandboxWakes = newCounterFamily(prometheus.CounterOpts{
		Name: "caddy_ktls_sandbox_wakes_total",
		Help: "Wakes of sandboxes whose target did not answer, by outcome: woken (the target answered after it), wake-failed (the control plane did not accept it), dial-failed (the target stayed silent for the wake timeout), redirected (the control plane answered with a redirect, which is not followed).",
	}, []string{"outcome"}, forward.WakeOutcomes())
	sandboxWakeDuration = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "caddy_ktls_sandbox_wake_duration_seconds",
		Help:    "Wakes from the wake request to the target's answer or the wake's failure.",
		Buckets: []float64{0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 20, 30, 60},
	})
)

func init() {
	metrics.addVecs(forwarderModules, sandboxWakes, sandboxWakeDuration)
}

// observeWake records a wake (forward.Config.OnWake).
func observeWake(ev forward.WakeEvent) {
	sandboxWakes.WithLabelValues(ev.Outcome).Inc()
	sandboxWakeDuration.Observe(ev.Duration.Seconds())
}

// kernelFeatures says, by feature of caddy_ktls_kernel_support, whether the
// kernel accepted it (ktls.Probe: probed once per process, then cached).
func kernelFeatures(caps ktls.Capabilities) map[string]bool {
	var tx, rx bool
	for _, c := range caps.Ciphers {
		tx, rx = tx || c.TX, rx || c.RX
	}
	ulp := caps.ULP == nil
	return map[string]bool{"tx": ulp && tx, "rx": ulp && rx, "rekey": ulp && caps.Rekey}
}

// Describe implements prometheus.Collector.
func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.tunnelsOpen, c.tunnelsOpened, c.tunnelsExpired, c.tunnelsRevoked, c.tunnelsClosed, c.closeRequests, c.closeRefused, c.bytes, c.rejects, c.relayBytes,
		c.controlRecords, c.pipeShortages, c.pushReports, c.offloads, c.offloadModes, c.connCloses, c.handshakeFails, c.acceptRetries, c.kernelSupport, c.throttled} {
		ch <- d
	}
	for _, v := range c.vecs {
		v.Describe(ch)
	}
}

// Collect implements prometheus.Collector: every family, every series.
func (c *collector) Collect(ch chan<- prometheus.Metric) {
	c.collect(ch, true)
}

// collect sends every series to ch; the kernel's answer to the probe
// (caddy_ktls_kernel_support) only where probe is set, as the probe is
// made once, by the first module that uses the kernel's TLS.
func (c *collector) collect(ch chan<- prometheus.Metric, probe bool) {
	open, opened := tunnels.Counts()
	ch <- prometheus.MustNewConstMetric(c.tunnelsOpen, prometheus.GaugeValue, float64(open))
	ch <- prometheus.MustNewConstMetric(c.tunnelsOpened, prometheus.CounterValue, float64(opened))
	ch <- prometheus.MustNewConstMetric(c.tunnelsExpired, prometheus.CounterValue, float64(tunnels.Expired()))
	ch <- prometheus.MustNewConstMetric(c.tunnelsRevoked, prometheus.CounterValue, float64(tunnels.Revoked()))
	ch <- prometheus.MustNewConstMetric(c.tunnelsClosed, prometheus.CounterValue, float64(tunnels.Closed()))
	for mode, n := range closeRequests.snapshot() {
		ch <- prometheus.MustNewConstMetric(c.closeRequests, prometheus.CounterValue, float64(n), mode)
	}
	for reason, n := range closeRefusals.snapshot() {
		ch <- prometheus.MustNewConstMetric(c.closeRefused, prometheus.CounterValue, float64(n), reason)
	}
	to, from := tunnels.Totals()
	ch <- prometheus.MustNewConstMetric(c.bytes, prometheus.CounterValue, float64(to), "to_sandbox")
	ch <- prometheus.MustNewConstMetric(c.bytes, prometheus.CounterValue, float64(from), "from_sandbox")
	throttledTo, throttledFrom := tunnels.Throttled()
	ch <- prometheus.MustNewConstMetric(c.throttled, prometheus.CounterValue, throttledTo.Seconds(), "to_sandbox")
	ch <- prometheus.MustNewConstMetric(c.throttled, prometheus.CounterValue, throttledFrom.Seconds(), "from_sandbox")
	rejects := tunnels.Rejections()
	for _, r := range rejectReasons() {
		ch <- prometheus.MustNewConstMetric(c.rejects, prometheus.CounterValue, float64(rejects[r]), r)
	}
	dp := tunnels.DataPath()
	ch <- prometheus.MustNewConstMetric(c.relayBytes, prometheus.CounterValue, float64(dp.SpliceBytes), "splice")
	ch <- prometheus.MustNewConstMetric(c.relayBytes, prometheus.CounterValue, float64(dp.CopyBytes), "copy")
	ch <- prometheus.MustNewConstMetric(c.controlRecords, prometheus.CounterValue, float64(dp.ControlRecords))
	ch <- prometheus.MustNewConstMetric(c.pipeShortages, prometheus.CounterValue, float64(dp.PipeShortages))
	ps := pushers.stats()
	ch <- prometheus.MustNewConstMetric(c.pushReports, prometheus.CounterValue, float64(ps.Sent), "sent")
	ch <- prometheus.MustNewConstMetric(c.pushReports, prometheus.CounterValue, float64(ps.Retries), "retried")
	ch <- prometheus.MustNewConstMetric(c.pushReports, prometheus.CounterValue, float64(ps.Dropped), "dropped")
	ch <- prometheus.MustNewConstMetric(c.pushReports, prometheus.CounterValue, float64(ps.Redirected), "redirected")
	for k, n := range handshakeOutcomes.snapshot() {
		ch <- prometheus.MustNewConstMetric(c.offloads, prometheus.CounterValue, float64(n), k.module, string(k.reason))
	}
	ks := ktls.Stats()
	for dir, modes := range map[string]map[ktls.Mode]uint64{"tx": ks.TX, "rx": ks.RX} {
		for mode, n := range modes {
			ch <- prometheus.MustNewConstMetric(c.offloadModes, prometheus.CounterValue, float64(n), dir, mode.String())
		}
	}
	for k, n := range connCloses.snapshot() {
		ch <- prometheus.MustNewConstMetric(c.connCloses, prometheus.CounterValue, float64(n), k.module, string(k.event))
	}
	for k, n := range handshakeFails.snapshot() {
		ch <- prometheus.MustNewConstMetric(c.handshakeFails, prometheus.CounterValue, float64(n), k.module, k.reason)
	}
	ch <- prometheus.MustNewConstMetric(c.acceptRetries, prometheus.CounterValue, float64(acceptRetries.Load()))
	if probe {
		for feature, ok := range kernelFeatures(ktls.Probe()) {
			v := 0.0
			if ok {
				v = 1
			}
			ch <- prometheus.MustNewConstMetric(c.kernelSupport, prometheus.GaugeValue, v, feature)
		}
	}
	for _, v := range c.vecs {
		v.Collect(ch)
	}
}

// closeEvents are the ktls events that end a connection.
var closeEvents = []ktls.EventKind{ktls.EventRateLimited, ktls.EventAlert, ktls.EventClosed, ktls.EventRekeyUnsupported, ktls.EventKeyExhausted, ktls.EventRefused}

// eventBadRecord counts the tunnels that a received record failing
// authentication ended (ktls.IsBadRecord). It is not a ktls event: on the
// kernel path the splice relay, not the conn, meets the record (EBADMSG), so
// the layer4 handler counts it from the tunnel's end error; the listener
// wrapper never sees its connections' read errors and has no such series.
const eventBadRecord ktls.EventKind = "bad-record"

// rejectReasons lists every reason a sandbox tunnel can be refused for, so
// each has a series from the start (alerts on rate() need the zero).
func rejectReasons() []string {
	var rs []string
	for _, r := range preamble.Reasons() {
		rs = append(rs, string(r))
	}
	for _, r := range forward.Reasons() {
		rs = append(rs, string(r))
	}
	return append(rs, preamble.ReasonOther)
}

// metricsView is what one configuration's metrics registry exports of the
// process's metrics (the collector): the families and series its loaded
// modules can move, and every series that has moved, so that a reload that
// removes a module hides nothing it counted. A series with a module label
// is that module's; one without, its family's (collector.movers). Caddy
// makes a registry for each configuration load; each module adds itself to
// its load's view as it provisions (registerMetrics).
type metricsView struct {
	c       *collector
	mu      sync.Mutex
	modules map[string]bool
}

// views holds the view of each loaded configuration's registry.
var views = struct {
	sync.Mutex
	m map[*prometheus.Registry]*metricsView
}{m: map[*prometheus.Registry]*metricsView{}}

// registerMetrics exports the process's metrics into this configuration's
// registry, with what module can move among them.
func registerMetrics(ctx caddy.Context, module string) error {
	if !slices.Contains(anyModule, module) {
		return fmt.Errorf("metrics: %s is not in the tables of the modules that move metrics (metrics.go)", module)
	}
	reg := ctx.GetMetricsRegistry()
	views.Lock()
	v := views.m[reg]
	if v == nil {
		v = &metricsView{c: metrics, modules: map[string]bool{}}
		if err := reg.Register(v); err != nil {
			views.Unlock()
			return err
		}
		views.m[reg] = v
		if ctx.Context != nil {
			// The load's context ends when the configuration is unloaded.
			context.AfterFunc(ctx, func() {
				views.Lock()
				delete(views.m, reg)
				views.Unlock()
			})
		}
	}
	views.Unlock()
	v.mu.Lock()
	v.modules[module] = true
	v.mu.Unlock()
	return nil
}

// Describe implements prometheus.Collector: every family the collector
// has, whether or not this configuration exports it.
func (v *metricsView) Describe(ch chan<- *prometheus.Desc) {
	v.c.Describe(ch)
}

// Collect implements prometheus.Collector.
func (v *metricsView) Collect(ch chan<- prometheus.Metric) {
	v.mu.Lock()
	loaded := maps.Clone(v.modules)
	v.mu.Unlock()
	all := make(chan prometheus.Metric, 64)
	go func() {
		v.c.collect(all, slices.ContainsFunc(engineModules, func(m string) bool { return loaded[m] }))
		close(all)
	}()
	for m := range all {
		if v.c.exports(m, loaded) {
			ch <- m
		}
	}
}

// exports says whether a configuration whose modules are loaded exports m:
// when one of them can move it, or it has moved.
func (c *collector) exports(m prometheus.Metric, loaded map[string]bool) bool {
	movers, ok := c.movers[m.Desc()]
	if !ok {
		undeclaredSeries(m.Desc().String(), "a family no module is declared to move")
		return true
	}
	var pb dto.Metric
	if err := m.Write(&pb); err != nil {
		return true
	}
	for _, l := range pb.GetLabel() {
		if l.GetName() == "module" {
			movers = []string{l.GetValue()}
		}
	}
	if slices.ContainsFunc(movers, func(m string) bool { return loaded[m] }) {
		return true
	}
	switch {
	case pb.Counter != nil:
		return pb.Counter.GetValue() != 0
	case pb.Gauge != nil:
		return pb.Gauge.GetValue() != 0
	case pb.Histogram != nil:
		return pb.Histogram.GetSampleCount() != 0
	}
	return true
}

// counterFamily is a CounterVec whose series are declared where it is
// made, from the tables of the code that observes it: each exists from
// zero, and one that was not declared is counted all the same and
// reported (undeclaredSeries).
type counterFamily struct {
	*prometheus.CounterVec
	name     string
	declared map[string]bool
}

// newCounterFamily makes a counterFamily with a series for every
// combination of the label values (one list per label).
func newCounterFamily(opts prometheus.CounterOpts, labels []string, values ...[]string) *counterFamily {
	f := &counterFamily{CounterVec: prometheus.NewCounterVec(opts, labels), name: opts.Name, declared: map[string]bool{}}
	for _, lvs := range labelSets(values) {
		f.CounterVec.WithLabelValues(lvs...)
		f.declared[strings.Join(lvs, "\x00")] = true
	}
	return f
}

// WithLabelValues returns the counter of lvs.
func (f *counterFamily) WithLabelValues(lvs ...string) prometheus.Counter {
	if !f.declared[strings.Join(lvs, "\x00")] {
		undeclaredSeries(f.name, strings.Join(lvs, ","))
	}
	return f.CounterVec.WithLabelValues(lvs...)
}

// histogramFamily is counterFamily's HistogramVec.
type histogramFamily struct {
	*prometheus.HistogramVec
	name     string
	declared map[string]bool
}

func newHistogramFamily(opts prometheus.HistogramOpts, labels []string, values ...[]string) *histogramFamily {
	f := &histogramFamily{HistogramVec: prometheus.NewHistogramVec(opts, labels), name: opts.Name, declared: map[string]bool{}}
	for _, lvs := range labelSets(values) {
		f.HistogramVec.WithLabelValues(lvs...)
		f.declared[strings.Join(lvs, "\x00")] = true
	}
	return f
}

// WithLabelValues returns the histogram of lvs.
func (f *histogramFamily) WithLabelValues(lvs ...string) prometheus.Observer {
	if !f.declared[strings.Join(lvs, "\x00")] {
		undeclaredSeries(f.name, strings.Join(lvs, ","))
	}
	return f.HistogramVec.WithLabelValues(lvs...)
}

// labelSets returns every combination of one value from each list.
func labelSets(values [][]string) [][]string {
	sets := [][]string{nil}
	for _, vs := range values {
		var next [][]string
		for _, set := range sets {
			for _, v := range vs {
				next = append(next, append(slices.Clip(set), v))
			}
		}
		sets = next
	}
	return sets
}

// undeclaredPanics makes undeclaredSeries panic: the tests set it, so that
// an observation the tables miss fails the test that made it.
var undeclaredPanics bool

// undeclaredSeries reports an observation of series, which metric did not
// declare: a table that misses a value some code observes. The observation
// is counted all the same; this is said once per series, at ERROR.
func undeclaredSeries(metric, series string) {
	if undeclaredPanics {
		panic(fmt.Sprintf("metric %s: series %s was not declared: add its label values to the table that declares them", metric, series))
	}
	logUndeclared(caddy.Log(), metric, series)
}

// undeclaredLogged holds the series logUndeclared has logged.
var undeclaredLogged sync.Map

func logUndeclared(logger *zap.Logger, metric, series string) {
	if _, logged := undeclaredLogged.LoadOrStore(metric+"\x00"+series, true); logged {
		return
	}
	logger.Error("metric series not declared: counted, but it had no series from zero (a bug in caddy-ktls: please report it)",
		zap.String("metric", metric), zap.String("series", series))
}
