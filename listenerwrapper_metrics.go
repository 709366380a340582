package caddyktls

import (
	"sync/atomic"

	"github.com/ktlsingress/caddy-ktls/internal/caddymetrics"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/prometheus/client_golang/prometheus"
)

// HTTP response body writes that net/http handed whole to the ktls listener
// wrapper's connections (ReadFrom, `sendfile` on), by path:
// caddy_ktls_http_body_writes_total and caddy_ktls_http_body_bytes_total. Handshake outcomes (offloaded TX/RX by
// mode, fallbacks by reason) are the engine's families (internal/offload).
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

// listenerCollector exports the ReadFrom counters. Like every family it
// is made once per process and exported into every configuration's
// registry (caddymetrics), so the counts survive reloads.
type listenerCollector struct{ calls, bytes *prometheus.Desc }

var listenerMetrics = &listenerCollector{
	calls: prometheus.NewDesc("caddy_ktls_http_body_writes_total",
		"HTTP/1.1 response body writes that net/http handed whole to a ktls listener wrapper connection (only with its sendfile option; Caddy writes a file in chunks, one write each), by path: sendfile (a file sent with sendfile(2), encrypted by the kernel) or copy (written through a userspace buffer: not a file, or TX not in the kernel).",
		[]string{"path"}, nil),
	bytes: prometheus.NewDesc("caddy_ktls_http_body_bytes_total",
		"Bytes of the writes counted by caddy_ktls_http_body_writes_total, by path (sendfile, copy); net/http writes the first 512 bytes of a body itself, outside these.",
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

func init() {
	caddymetrics.Add([]string{moduleid.ListenerWrapper}, listenerMetrics)
}
