package handoff

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/ktlsingress/caddy-ktls/internal/caddymetrics"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
)

// The upgrades (sandbox_handoff): each handoff by the role this process
// played (old: it handed over; new: it took over) and its result, each
// tunnel offered, and how long each moved tunnel stood still (a pause is a
// record boundary away: a millisecond or a few; 10 ms is the goal's bound).
var (
	handoffs = caddymetrics.NewCounterFamily(prometheus.CounterOpts{
		Name: "caddy_ktls_sandbox_handoffs_total",
		Help: "Upgrades without dropping a tunnel, by role (old: this process handed its state and tunnels over; new: it took them over) and result (done: the process state moved; failed: nothing moved, the old process serves on; peer_died: the other process died during the handoff, this one serves on with what it holds).",
	}, []string{"role", "result"}, []string{"old", "new"}, []string{"done", "failed", "peer_died"})
	handoffTunnels = caddymetrics.NewCounterFamily(prometheus.CounterOpts{
		Name: "caddy_ktls_sandbox_handoff_tunnels_total",
		Help: "Tunnels offered in upgrades, by result: moved and stayed, counted by the old process (stayed: running on there until they end or its drain ends them); adopted and refused, counted by the new one (refused: they stayed in the old process).",
	}, []string{"result"}, []string{"moved", "stayed", "adopted", "refused"})
	handoffPause = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "caddy_ktls_sandbox_handoff_pause_seconds",
		Help:    "How long each tunnel moved in an upgrade stood still, from its pause in the old process to its transfer's answer; observed by the old process.",
		Buckets: []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5},
	})
)

func init() {
	// A forwarder's sandbox handler exports them: the process that moves
	// its tunnels.
	caddymetrics.Add(moduleid.Forwarder, handoffs, handoffTunnels, handoffPause)
}
