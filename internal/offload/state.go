package offload

import (
	"slices"

	"github.com/ktlsingress/caddy-ktls/internal/caddymetrics"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// Process-level state: what outlives a configuration load. Caddy makes
// every module instance anew at each load, and the metrics must never go
// backwards nor lose a series across a reload, so the engine's counts live
// here, in package variables, never in a module: one series per module and
// outcome, event or reason from the start. The families in metrics.go read
// them at scrape time.

// CloseKey is a series of caddy_ktls_connections_closed_total.
type CloseKey struct {
	Module string
	Event  ktls.EventKind
}

// connCloses counts the connections the ktls engine closed, per module and
// event (and the layer4 handler's bad records).
var connCloses = func() *caddymetrics.SeriesCounts[CloseKey] {
	var keys []CloseKey
	for _, m := range moduleid.Engine {
		for _, ev := range CloseEvents {
			keys = append(keys, CloseKey{m, ev})
		}
	}
	return caddymetrics.NewSeriesCounts("caddy_ktls_connections_closed_total", append(keys, CloseKey{moduleid.L4Handler, EventBadRecord}))
}()

// CountClose records ev for module when it is a close event, or the layer4
// handler's EventBadRecord. Every handshake reports an event too: those
// return before taking the lock.
func CountClose(module string, ev ktls.EventKind) {
	if slices.Contains(CloseEvents, ev) || ev == EventBadRecord {
		connCloses.Add(CloseKey{module, ev})
	}
}

// OutcomeKey is a series of caddy_ktls_handshakes_total.
type OutcomeKey struct {
	Module string
	Reason ktls.Reason
}

// handshakeOutcomes counts the handshakes of each module's connections by
// offload outcome (caddy_ktls_handshakes_total{module,reason}).
var handshakeOutcomes = func() *caddymetrics.SeriesCounts[OutcomeKey] {
	var keys []OutcomeKey
	for _, m := range moduleid.Engine {
		for _, r := range ktls.Reasons() {
			keys = append(keys, OutcomeKey{m, r})
		}
	}
	return caddymetrics.NewSeriesCounts("caddy_ktls_handshakes_total", keys)
}()

// FailKey is a series of caddy_ktls_handshake_failures_total.
type FailKey struct{ Module, Reason string }

// handshakeFails counts failed TLS handshakes per module and reason.
var handshakeFails = func() *caddymetrics.SeriesCounts[FailKey] {
	var keys []FailKey
	for _, m := range moduleid.Server {
		for _, r := range HandshakeFailureReasons {
			keys = append(keys, FailKey{m, r})
		}
	}
	return caddymetrics.NewSeriesCounts("caddy_ktls_handshake_failures_total", keys)
}()

// CountHandshakeFailure counts a failed handshake of module for reason.
func CountHandshakeFailure(module, reason string) {
	handshakeFails.Add(FailKey{module, reason})
}

// ConnCloseCounts, HandshakeOutcomeCounts and HandshakeFailureCounts are
// the counts so far, by series.
func ConnCloseCounts() map[CloseKey]uint64          { return connCloses.Snapshot() }
func HandshakeOutcomeCounts() map[OutcomeKey]uint64 { return handshakeOutcomes.Snapshot() }
func HandshakeFailureCounts() map[FailKey]uint64    { return handshakeFails.Snapshot() }
