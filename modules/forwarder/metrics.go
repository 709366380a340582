package forwarder

import (
	"time"

	"github.com/ktlsingress/caddy-ktls/forward"
	"github.com/ktlsingress/caddy-ktls/internal/caddymetrics"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/preamble"
	"github.com/prometheus/client_golang/prometheus"
)

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
	sandboxWakes = caddymetrics.NewCounterFamily(prometheus.CounterOpts{
		Name: "caddy_ktls_sandbox_wakes_total",
		Help: "Wakes of sandboxes whose target did not answer, by outcome: woken (the target answered after it), wake-failed (the control plane did not accept it), dial-failed (the target stayed silent for the wake timeout), redirected (the control plane answered with a redirect, which is not followed).",
	}, []string{"outcome"}, forward.WakeOutcomes())
	sandboxWakeDuration = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "caddy_ktls_sandbox_wake_duration_seconds",
		Help:    "Wakes from the wake request to the target's answer or the wake's failure.",
		Buckets: []float64{0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 20, 30, 60},
	})
)

// observeWake records a wake (forward.Config.OnWake).
func observeWake(ev forward.WakeEvent) {
	sandboxWakes.WithLabelValues(ev.Outcome).Inc()
	sandboxWakeDuration.Observe(ev.Duration.Seconds())
}

// rejectReasons lists every reason a sandbox tunnel can be refused for, so
// each has a series from the start (alerts on rate() need the zero).
func RefusalReasons() []string {
	var rs []string
	for _, r := range preamble.Reasons() {
		rs = append(rs, string(r))
	}
	for _, r := range forward.Reasons() {
		rs = append(rs, string(r))
	}
	return append(rs, preamble.ReasonOther)
}

// The forwarder's families of constant metrics, read from its process state
// (state.go) at scrape time.
var (
	descTunnelsOpen     = prometheus.NewDesc("caddy_ktls_sandbox_tunnels_active", "Sandbox tunnels open now.", nil, nil)
	descDialsInProgress = prometheus.NewDesc("caddy_ktls_sandbox_dials_in_progress",
		"Sandbox tunnels dialing their target now, a wake included; beyond max_dials a tunnel is refused (caddy_ktls_sandbox_rejects_total{reason=\"overloaded\"}).", nil, nil)
	descStandbyWaiting = prometheus.NewDesc("caddy_ktls_sandbox_standby_connections",
		"Gateways' standby connections waiting for their first preamble byte now (mutual TLS done; standby_timeout).", nil, nil)
	descStandbyEnds = prometheus.NewDesc("caddy_ktls_sandbox_standby_ends_total",
		"Gateways' standby connections that ended without a preamble, by end: closed (by the gateway), expired (standby_timeout passed), moved (to the process of an upgrade, sandbox_handoff). No refusal: nothing was asked for.", []string{"end"}, nil)
	descTunnelsOpened  = prometheus.NewDesc("caddy_ktls_sandbox_tunnels_total", "Sandbox tunnels opened since the process started.", nil, nil)
	descTunnelsExpired = prometheus.NewDesc("caddy_ktls_sandbox_tunnels_expired_total", "Sandbox tunnels ended for reaching max_tunnel_lifetime.", nil, nil)
	descTunnelsRevoked = prometheus.NewDesc("caddy_ktls_sandbox_tunnels_revoked_total", "Sandbox tunnels ended because a reload left their signing key trusted by no configuration.", nil, nil)
	descTunnelsClosed  = prometheus.NewDesc("caddy_ktls_sandbox_tunnels_closed_total", "Sandbox tunnels ended as failures by POST /sandbox/close (at once, or still open when its grace period ended).", nil, nil)
	descCloseRequests  = prometheus.NewDesc("caddy_ktls_sandbox_close_requests_total",
		"POST /sandbox/close requests served, by mode: fail (end the tunnels at once), graceful (end those still open after a grace period).", []string{"mode"}, nil)
	descCloseRefused = prometheus.NewDesc("caddy_ktls_sandbox_close_refused_total",
		"POST /sandbox/close requests refused, nothing closed, by reason: method (not POST, 405), content-type (not application/json, 415), too-large (a body over 64 KiB, 413), bad-request (no valid close request, 400), refusals-full (refuse_for beyond the sandboxes refused at once, 429).", []string{"reason"}, nil)
	descBytes      = prometheus.NewDesc("caddy_ktls_sandbox_bytes_total", "Bytes relayed by sandbox tunnels, by direction (to_sandbox, from_sandbox).", []string{"direction"}, nil)
	descRefused    = prometheus.NewDesc("caddy_ktls_sandbox_rejects_total", "Refused sandbox tunnels by reason.", []string{"reason"}, nil)
	descRelayBytes = prometheus.NewDesc("caddy_ktls_relay_bytes_total",
		"Bytes of closed sandbox tunnels by data path: splice (socket to socket through a kernel pipe, never in userspace) or copy (through a userspace buffer: a direction in userspace TLS, or a burst without a pipe).",
		[]string{"path"}, nil)
	descControlRecords = prometheus.NewDesc("caddy_ktls_relay_control_records_total", "TLS control records (alerts, post-handshake messages such as KeyUpdate) read in userspace from kernel-TLS sockets during the relays of closed sandbox tunnels.", nil, nil)
	descPipeShortages  = prometheus.NewDesc("caddy_ktls_relay_pipe_shortages_total",
		"Transfer bursts of closed tunnels copied through userspace because no pipe could be opened (the process or system out of file descriptors).", nil, nil)
	descPushReports = prometheus.NewDesc("caddy_ktls_activity_reports_total", "Activity reports by outcome (sent, retried, dropped), and the POST attempts answered with a redirect, which is not followed (redirected; each is also retried or ends in dropped).", []string{"outcome"}, nil)
	descThrottled   = prometheus.NewDesc("caddy_ktls_sandbox_throttled_seconds_total",
		"Time the directions of closed sandbox tunnels waited for their sandbox's max_bandwidth cap, by direction (to_sandbox, from_sandbox).",
		[]string{"direction"}, nil)
)

func init() {
	caddymetrics.Add(moduleid.Forwarder, &caddymetrics.Gathered{
		Descs:  []*prometheus.Desc{descTunnelsOpen, descDialsInProgress, descStandbyWaiting, descStandbyEnds, descTunnelsOpened, descTunnelsExpired, descTunnelsRevoked, descTunnelsClosed, descCloseRequests, descCloseRefused, descBytes, descRefused, descRelayBytes, descControlRecords, descPipeShortages, descPushReports, descThrottled},
		Gather: gather,
	}, tunnelDuration, dialDuration, preambleVerifyDuration, sandboxWakes, sandboxWakeDuration)
}

// gather sends the series of the forwarder's constant metrics.
func gather(ch chan<- prometheus.Metric) {
	counter := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, labels...)
	}
	open, opened := tunnels.Counts()
	ch <- prometheus.MustNewConstMetric(descTunnelsOpen, prometheus.GaugeValue, float64(open))
	ch <- prometheus.MustNewConstMetric(descDialsInProgress, prometheus.GaugeValue, float64(tunnels.Dialing()))
	waiting, ends := tunnels.Standby()
	ch <- prometheus.MustNewConstMetric(descStandbyWaiting, prometheus.GaugeValue, float64(waiting))
	for _, end := range forward.StandbyEnds() {
		counter(descStandbyEnds, float64(ends[end]), end)
	}
	counter(descTunnelsOpened, float64(opened))
	counter(descTunnelsExpired, float64(tunnels.Expired()))
	counter(descTunnelsRevoked, float64(tunnels.Revoked()))
	counter(descTunnelsClosed, float64(tunnels.Closed()))
	for mode, n := range closeRequests.Snapshot() {
		counter(descCloseRequests, float64(n), mode)
	}
	for reason, n := range closeRefusals.Snapshot() {
		counter(descCloseRefused, float64(n), reason)
	}
	to, from := tunnels.Totals()
	counter(descBytes, float64(to), "to_sandbox")
	counter(descBytes, float64(from), "from_sandbox")
	throttledTo, throttledFrom := tunnels.Throttled()
	counter(descThrottled, throttledTo.Seconds(), "to_sandbox")
	counter(descThrottled, throttledFrom.Seconds(), "from_sandbox")
	rejects := tunnels.RefusedTunnels()
	for _, r := range RefusalReasons() {
		counter(descRefused, float64(rejects[r]), r)
	}
	dp := tunnels.DataPath()
	counter(descRelayBytes, float64(dp.SpliceBytes), "splice")
	counter(descRelayBytes, float64(dp.CopyBytes), "copy")
	counter(descControlRecords, float64(dp.ControlRecords))
	counter(descPipeShortages, float64(dp.PipeShortages))
	ps := pushers.Stats()
	counter(descPushReports, float64(ps.Sent), "sent")
	counter(descPushReports, float64(ps.Retries), "retried")
	counter(descPushReports, float64(ps.Dropped), "dropped")
	counter(descPushReports, float64(ps.Redirected), "redirected")
}
