package caddyktls

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
)

// TestListenerWrapperOptions runs traffic through the wrapper with each
// offload option on this kernel without kTLS: everything still works in
// userspace TLS, and the handshakes count under the option's reason where
// it decides before the kernel is asked (offload off: disabled; a CBC
// suite: cipher). `fallback refuse` refuses every connection here:
// TestListenerWrapperFallbackRefuse.
func TestListenerWrapperOptions(t *testing.T) {
	if kerneltest.Available() == nil {
		t.Skip("kTLS is available here: TestKernelListenerWrapperOptions covers this kernel")
	}
	lwOptions(t, false)
}

// TestKernelListenerWrapperOptions is the same on a kTLS kernel, where
// each option changes what the kernel does (tls_stat) and `fallback refuse`
// refuses the connection it cannot offload (TLS 1.2 with a CBC suite).
func TestKernelListenerWrapperOptions(t *testing.T) {
	kerneltest.Require(t)
	lwOptions(t, true)
}

// lwCBCSuite is a TLS 1.2 suite Go and Caddy accept but kTLS has no
// cipher for: a connection that cannot be offloaded on any kernel.
const lwCBCSuite = tls.TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA

// lwOptionCase is one wrapper configuration and what its connections must
// do: on the kTLS kernel (kernel*) and on one without (host*).
type lwOptionCase struct {
	name    string
	wrapper map[string]any
	// reason and TX/RX modes of the TLS 1.3 connections, and the
	// tls_stat counters they must move (by one per connection; absent: 0).
	kernelReason, kernelTX, kernelRX string
	kernelStat                       []string
	hostReason                       string
	// cbc: a TLS 1.2 CBC client connects too; refused says it must be
	// refused (closed without a response) rather than served; kernelOnly
	// cases cannot be loaded on a kernel without kTLS.
	cbc, refused, kernelOnly bool
}

var lwOptionCases = []lwOptionCase{
	{name: "rx off", wrapper: map[string]any{"disable_rx": true},
		kernelReason: "rx-disabled", kernelTX: "sw", kernelRX: "userspace", kernelStat: []string{"TlsTxSw"},
		hostReason: "no-kernel-support"},
	{name: "offload off", wrapper: map[string]any{"disable_offload": true},
		kernelReason: "disabled", kernelTX: "userspace", kernelRX: "userspace", hostReason: "disabled"},
	{name: "expect_no_pad", wrapper: map[string]any{"expect_no_pad": true},
		kernelReason: "none", kernelTX: "sw", kernelRX: "sw", kernelStat: []string{"TlsTxSw", "TlsRxSw"},
		hostReason: "no-kernel-support"},
	{name: "fallback allow, CBC client", wrapper: map[string]any{}, cbc: true,
		kernelReason: "none", kernelTX: "sw", kernelRX: "sw", kernelStat: []string{"TlsTxSw", "TlsRxSw"},
		hostReason: "no-kernel-support"},
	{name: "fallback refuse, CBC client", wrapper: map[string]any{"require_offload": true}, cbc: true, refused: true, kernelOnly: true,
		kernelReason: "none", kernelTX: "sw", kernelRX: "sw", kernelStat: []string{"TlsTxSw", "TlsRxSw"}},
}

// lwOptionStats are the tls_stat counters the options test accounts for.
var lwOptionStats = []string{"TlsTxSw", "TlsRxSw", "TlsRxNoPadViolation", "TlsDecryptError"}

func lwOptions(t *testing.T, kernel bool) {
	for _, tc := range lwOptionCases {
		if tc.kernelOnly && !kernel {
			continue
		}
		t.Run(tc.name, func(t *testing.T) { lwOption(t, tc, kernel) })
	}
}

// lwOption downloads the site's file and uploads it through reverse_proxy
// over HTTP/1.1 and HTTP/2 (two TLS 1.3 connections, SHA-256 both ways),
// then, with tc.cbc, makes one TLS 1.2 CBC connection, and checks the
// wrapper's /metrics, tls_stat (kernel) and the CBC connection's log line.
func lwOption(t *testing.T, tc lwOptionCase, kernel bool) {
	s := lwStart(t, &lwSite{wrapper: tc.wrapper,
		cipherSuites: []string{tls.CipherSuiteName(lwCBCSuite), "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256"}})
	reason, tx, rx := tc.hostReason, "userspace", "userspace"
	if kernel {
		reason, tx, rx = tc.kernelReason, tc.kernelTX, tc.kernelRX
	}
	want := map[string]float64{
		`caddy_ktls_handshakes_total{module="caddy.listeners.ktls",reason="` + reason + `"}`: 2,
		`caddy_ktls_offload_directions_total{direction="tx",mode="` + tx + `"}`:              2,
		`caddy_ktls_offload_directions_total{direction="rx",mode="` + rx + `"}`:              2,
	}
	if tc.refused {
		want[`caddy_ktls_connections_closed_total{event="refused",module="caddy.listeners.ktls"}`] = 1
	}
	if tc.cbc {
		// Userspace both ways whether served or refused.
		want[`caddy_ktls_handshakes_total{module="caddy.listeners.ktls",reason="cipher"}`]++
		want[`caddy_ktls_offload_directions_total{direction="tx",mode="userspace"}`]++
		want[`caddy_ktls_offload_directions_total{direction="rx",mode="userspace"}`]++
	}
	var cbcAddr string
	traffic := func() {
		for _, c := range []struct {
			client *http.Client
			major  int
		}{{s.h1(nil), 1}, {s.h2(nil), 2}} {
			if got := lwGet(t, c.client, s.url("localhost", "/files/blob.bin"), c.major); lwSHA(got) != lwSHA(s.file) || len(got) != len(s.file) {
				t.Errorf("HTTP/%d download: %d bytes, SHA-256 %s; want %d bytes, %s", c.major, len(got), lwSHA(got), len(s.file), lwSHA(s.file))
			}
			if got, want := string(lwPost(t, c.client, s.url("localhost", "/upload"), s.file, c.major)), fmt.Sprintf("%s %d", lwSHA(s.file), len(s.file)); got != want {
				t.Errorf("HTTP/%d upload: the upstream saw %q, want %q", c.major, got, want)
			}
			c.client.CloseIdleConnections()
		}
		if tc.cbc {
			cbcAddr = lwCBCRequest(t, s, tc.refused)
		}
	}
	before := parseMetrics(t, adminGet(t, s.adminAddr, "/metrics"))
	if kernel {
		delta := kerneltest.StatDelta(t, traffic)
		for _, name := range lwOptionStats {
			var want int64
			for _, moved := range tc.kernelStat {
				if moved == name {
					want = 2 // the two TLS 1.3 connections; never the CBC one
				}
			}
			if delta[name] != want {
				t.Errorf("tls_stat %s moved by %d, want %d (delta %v)", name, delta[name], want, delta)
			}
		}
	} else {
		traffic()
	}
	lwCheckSeries(t, "traffic", before, parseMetrics(t, adminGet(t, s.adminAddr, "/metrics")), want)
	// Whether TLS_RX_EXPECT_NO_PAD is in effect, as the kernel reports it
	// on each TLS 1.3 connection: only expect_no_pad on a kTLS kernel.
	wantNoPad := kernel && tc.wrapper["expect_no_pad"] == true
	tls13 := 0
	for _, l := range s.logLines(t, "kernel TLS handshake") {
		if l["version"] != tls.VersionName(tls.VersionTLS13) {
			continue
		}
		tls13++
		if l["rx_no_pad"] != wantNoPad {
			t.Errorf("TLS 1.3 handshake log line %v: rx_no_pad %v, want %v", l, l["rx_no_pad"], wantNoPad)
		}
	}
	if tls13 < 2 {
		t.Errorf("%d TLS 1.3 handshake log lines, want at least the 2 of the traffic", tls13)
	}
	if !tc.cbc {
		return
	}
	// The CBC connection's debug line says why it stayed in userspace
	// (with fallback refuse: why it was closed).
	var lines []map[string]any
	for _, l := range s.logLines(t, "kernel TLS handshake") {
		if l["remote"] == cbcAddr {
			lines = append(lines, l)
		}
	}
	if len(lines) != 1 || lines[0]["reason"] != "cipher" || lines[0]["cipher_suite"] != tls.CipherSuiteName(lwCBCSuite) || lines[0]["tx"] != "userspace" {
		t.Errorf("handshake log lines of the CBC connection %s: %v; want one, reason cipher, %s, tx userspace", cbcAddr, lines, tls.CipherSuiteName(lwCBCSuite))
	}
}

// lwCBCRequest makes one HTTP/1.1 request over TLS 1.2 with lwCBCSuite
// and returns the client's address. Served, it must see the TLS 1.2 CBC
// session in the placeholders; refused, the handshake completes (the
// server decides after it) and the connection closes without a response.
func lwCBCRequest(t *testing.T, s *lwSite, refused bool) string {
	t.Helper()
	cfg := s.tlsConfig(nil, false)
	cfg.MaxVersion, cfg.CipherSuites = tls.VersionTLS12, []uint16{lwCBCSuite}
	var addr string
	tr := s.transport(cfg, false)
	dial := tr.DialContext
	tr.DialContext = func(ctx context.Context, network, a string) (net.Conn, error) {
		c, err := dial(ctx, network, a)
		if err == nil {
			addr = c.LocalAddr().String()
		}
		return c, err
	}
	c := &http.Client{Transport: tr, Timeout: time.Minute}
	defer c.CloseIdleConnections()
	resp, err := c.Get(s.url("localhost", "/tls"))
	switch {
	case refused && err == nil:
		resp.Body.Close()
		t.Errorf("fallback refuse: a TLS 1.2 CBC connection got %s, want it closed", resp.Status)
	case refused && !errors.Is(err, syscall.ECONNRESET):
		t.Errorf("fallback refuse: the TLS 1.2 CBC request failed with %v, want a reset (a refusal in userspace TLS)", err)
	case refused:
		t.Logf("fallback refuse: the TLS 1.2 CBC request was reset: %v", err)
	case err != nil:
		t.Errorf("a TLS 1.2 CBC connection with fallback allowed: %v", err)
	default:
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if want := " https tls1.2 " + tls.CipherSuiteName(lwCBCSuite) + " http/1.1 "; !strings.Contains(string(body), want) {
			t.Errorf("a TLS 1.2 CBC connection: placeholders %q, want %q in them", body, want)
		}
	}
	if addr == "" {
		t.Fatal("the CBC client never dialled")
	}
	return addr
}
