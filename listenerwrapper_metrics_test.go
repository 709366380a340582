package caddyktls

import (
	"strings"
	"testing"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
)

// TestListenerWrapperMetrics scrapes Caddy's /metrics (admin API) around
// traffic through the ktls wrapper, with only the wrapper configured (no
// layer4): every kTLS series moves by exactly what the connections did,
// and an admin-API reload (POST /load) neither resets nor drops a series.
// On this kernel every connection falls back to userspace TLS.
func TestListenerWrapperMetrics(t *testing.T) {
	if kerneltest.Available() == nil {
		t.Skip("kTLS is available here: TestKernelListenerWrapperMetrics covers this kernel")
	}
	lwMetrics(t, false)
}

// TestKernelListenerWrapperMetrics is the same on a kTLS kernel: the
// handshakes are offloaded (reason none, TX and RX in the kernel's
// software mode) and the HTTP/1.1 file body goes out with sendfile.
func TestKernelListenerWrapperMetrics(t *testing.T) {
	kerneltest.Require(t)
	lwMetrics(t, true)
}

func lwMetrics(t *testing.T, kernel bool) {
	s := lwStartSite(t, map[string]any{"sendfile": true})
	scrape := func() map[string]float64 { return parseMetrics(t, adminGet(t, s.adminAddr, "/metrics")) }
	reason, mode := "no-kernel-support", "userspace"
	if kernel {
		reason, mode = "none", "sw"
	}
	// Two connections: an HTTP/1.1 download and an HTTP/2 request.
	want := map[string]float64{
		`caddy_ktls_handshakes_total{module="caddy.listeners.ktls",reason="` + reason + `"}`: 2,
		`caddy_ktls_offload_directions_total{direction="tx",mode="` + mode + `"}`:            2,
		`caddy_ktls_offload_directions_total{direction="rx",mode="` + mode + `"}`:            2,
	}
	if kernel {
		// The download goes out with sendfile (once per Caddy chunk;
		// net/http writes the first 512 bytes itself to sniff the content
		// type); HTTP/2 never does. Without kTLS sendfile is not in effect
		// and no series of it moves.
		want[`caddy_ktls_http_body_writes_total{path="sendfile"}`] = float64((len(s.file) + caddyMaxWriteChunk - 1) / caddyMaxWriteChunk)
		want[`caddy_ktls_http_body_bytes_total{path="sendfile"}`] = float64(len(s.file) - 512)
	}
	traffic := func(version string) {
		t.Helper()
		h1, h2 := s.h1(nil), s.h2(nil)
		defer h1.CloseIdleConnections()
		defer h2.CloseIdleConnections()
		if got := lwGet(t, h1, s.url("localhost", "/files/blob.bin"), 1); lwSHA(got) != lwSHA(s.file) {
			t.Fatalf("download: %d bytes, not the file's SHA-256", len(got))
		}
		if got := string(lwGet(t, h2, s.url("localhost", "/tls"), 2)); !strings.HasPrefix(got, version+" https ") {
			t.Fatalf("HTTP/2 request: %q, want the %s config", got, version)
		}
	}
	m0 := scrape()
	traffic("v1")
	m1 := scrape()
	lwCheckSeries(t, "traffic", m0, m1, want)

	// A reload builds a new metrics registry; the collectors are
	// registered into it again and carry on from the same process counts.
	s.reload(t, "v2")
	m2 := scrape()
	lwCheckSeries(t, "reload", m1, m2, nil)
	traffic("v2")
	lwCheckSeries(t, "traffic after the reload", m2, scrape(), want)
}
