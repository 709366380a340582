package caddyktls

import (
	"errors"
	"sync/atomic"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
)

// HTTP response bodies the ktls listener wrapper's connections copied with
// ReadFrom (sendfile mode), by path. Handshake outcomes (offloaded TX/RX by
// mode, fallbacks by reason) are exported by the package collector in
// metrics.go, which the wrapper registers as well.
var (
	readFromSendfile readFromCounter // a file, TX in the kernel: sendfile(2)
	readFromCopy     readFromCounter // anything else: copied through Write
)

type readFromCounter struct{ calls, bytes atomic.Uint64 }

func (c *readFromCounter) load() (calls, bytes uint64) { return c.calls.Load(), c.bytes.Load() }

// countReadFrom records one ReadFrom call that moved n bytes.
func countReadFrom(sendfile bool, n int64) {
	c := &readFromCopy
	if sendfile {
		c = &readFromSendfile
	}
	c.calls.Add(1)
	c.bytes.Add(uint64(max(n, 0)))
}

// listenerCollector exports the ReadFrom counters. Like the package
// collector it is created once per process and registered into every
// configuration's registry, so the counts survive reloads.
type listenerCollector struct{ calls, bytes *prometheus.Desc }

var listenerMetrics = &listenerCollector{
	calls: prometheus.NewDesc("caddy_ktls_http_readfrom_total",
		"HTTP response bodies copied by ReadFrom on kTLS connections (listener wrapper with sendfile), by path: sendfile (a file, encrypted by the kernel) or copy.",
		[]string{"path"}, nil),
	bytes: prometheus.NewDesc("caddy_ktls_http_readfrom_bytes_total",
		"Bytes of HTTP response bodies copied by ReadFrom on kTLS connections, by path: sendfile or copy.",
		[]string{"path"}, nil),
}

// Describe implements prometheus.Collector.
func (c *listenerCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.calls
	ch <- c.bytes
}

// Collect implements prometheus.Collector.
func (c *listenerCollector) Collect(ch chan<- prometheus.Metric) {
	for path, counter := range map[string]*readFromCounter{"sendfile": &readFromSendfile, "copy": &readFromCopy} {
		calls, bytes := counter.load()
		ch <- prometheus.MustNewConstMetric(c.calls, prometheus.CounterValue, float64(calls), path)
		ch <- prometheus.MustNewConstMetric(c.bytes, prometheus.CounterValue, float64(bytes), path)
	}
}

// registerListenerMetrics adds the listener collector to this
// configuration's registry (once: later wrappers find it there).
func registerListenerMetrics(ctx caddy.Context) error {
	err := ctx.GetMetricsRegistry().Register(listenerMetrics)
	var are prometheus.AlreadyRegisteredError
	if err != nil && !errors.As(err, &are) {
		return err
	}
	return nil
}
