package caddymetrics

import (
	"fmt"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// An observation of a series that was not declared is counted all the
// same, and reported: a panic in tests, one ERROR per series in production.
func TestUndeclaredSeriesCountedAndReported(t *testing.T) {
	c := NewSeriesCounts("caddy_ktls_test_total", []string{"known"})
	c.Add("known")
	panicked := func(f func()) (msg string) {
		defer func() {
			if r := recover(); r != nil {
				msg = fmt.Sprint(r)
			}
		}()
		f()
		return ""
	}
	msg := panicked(func() { c.Add("unknown") })
	if !strings.Contains(msg, "caddy_ktls_test_total") || !strings.Contains(msg, "unknown") {
		t.Errorf("an undeclared series: panic %q, want one naming the metric and the series", msg)
	}
	if got := c.Snapshot(); got["known"] != 1 || got["unknown"] != 1 {
		t.Errorf("counts %v, want known 1 and unknown 1: an undeclared observation is counted all the same", got)
	}
	// Once declared by its first observation, the series is not reported
	// again.
	if msg := panicked(func() { c.Add("unknown") }); msg != "" || c.Snapshot()["unknown"] != 2 {
		t.Errorf("second observation: panic %q, count %d; want no panic and 2", msg, c.Snapshot()["unknown"])
	}

	f := NewCounterFamily(prometheus.CounterOpts{Name: "caddy_ktls_test_family_total", Help: "test"}, []string{"module", "result"},
		[]string{"a"}, []string{"ok", "failed"})
	if msg := panicked(func() { f.WithLabelValues("a", "failed").Inc() }); msg != "" {
		t.Errorf("a declared series panicked: %s", msg)
	}
	if msg := panicked(func() { f.WithLabelValues("b", "ok").Inc() }); !strings.Contains(msg, "b,ok") {
		t.Errorf("an undeclared counterFamily series: panic %q, want one naming b,ok", msg)
	}
	h := NewHistogramFamily(prometheus.HistogramOpts{Name: "caddy_ktls_test_seconds", Help: "test"}, []string{"module"}, []string{"a"})
	if msg := panicked(func() { h.WithLabelValues("c").Observe(1) }); !strings.Contains(msg, "caddy_ktls_test_seconds") {
		t.Errorf("an undeclared histogramFamily series: panic %q", msg)
	}

	// Production: one ERROR per series, however often it is observed.
	core, logs := observer.New(zapcore.DebugLevel)
	for range 3 {
		logUndeclared(zap.New(core), "caddy_ktls_test_total", "{module:x}")
	}
	if entries := logs.All(); len(entries) != 1 || entries[0].Level != zapcore.ErrorLevel ||
		entries[0].ContextMap()["metric"] != "caddy_ktls_test_total" || entries[0].ContextMap()["series"] != "{module:x}" {
		t.Errorf("log %v, want one ERROR naming the metric and the series", entries)
	}
}
