package caddyktls

import (
	"context"
	"crypto/tls"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward"
	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/internal/offload"
	"github.com/ktlsingress/caddy-ktls/internal/sockerr"
	"github.com/ktlsingress/caddy-ktls/internal/testpki"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/modules/forwarder"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

// Slowloris at scale: hundreds of gateways' sessions each dribble a valid
// preamble one byte per second. Every one is cut at preamble_timeout with
// reason "timeout" (logged with the peer, counted), nothing is dialed for
// them, a normal tunnel opened during the attack works, and every fd and
// goroutine is released after.
func TestSandboxSlowlorisPreambles(t *testing.T) { sandboxSlowlorisPreambles(t, false) }

// TestKernelSandboxSlowlorisPreambles is TestSandboxSlowlorisPreambles on a
// kTLS kernel, where the dribbled preamble is read through kTLS RX: every
// slow session was offloaded (tls_stat) before it was cut.
func TestKernelSandboxSlowlorisPreambles(t *testing.T) {
	kerneltest.Require(t)
	sandboxSlowlorisPreambles(t, true)
}

func sandboxSlowlorisPreambles(t *testing.T, kernel bool) {
	slow := 500
	switch {
	case kernel:
		// The VM emulates the CPU (handshakes and AES ~250x slower); the
		// kernel facts (offloaded, then cut) do not need the scale.
		slow = 40
	case forwardtest.RaceEnabled:
		slow = 200 // the race detector makes each handshake ~10x dearer
	}
	size := int64(1 << 20)
	up := forwardtest.NewUpstream(t, size+3)
	e := newSandboxEnv(t, map[string]any{"preamble_timeout": "2s"})
	forwardtest.CheckLeaks(t)
	before := forwarder.Tunnels().RefusedTunnels()["timeout"]
	since := dataPathDelta(t, kernel)

	frame := e.gw.Frame(t, "sbx-slow", up.Addr())
	var wg sync.WaitGroup
	var dribbling sync.WaitGroup // until every slow session started to dribble
	read := make(chan int64, slow)
	handshakes := make(chan struct{}, 32) // bounded concurrent handshakes
	dribbling.Add(slow)
	for range slow {
		wg.Add(1)
		go func() {
			defer wg.Done()
			handshakes <- struct{}{}
			c, err := tls.Dial("tcp", e.addr, e.tlsConfig(e.client))
			<-handshakes
			dribbling.Done()
			if err != nil {
				t.Errorf("slow session handshake: %v", err)
				return
			}
			defer c.Close()
			done := make(chan struct{})
			go func() {
				defer close(done)
				c.SetReadDeadline(time.Now().Add(2 * time.Minute)) // liveness only
				n, _ := io.Copy(io.Discard, c)
				read <- n
			}()
			tick := time.NewTicker(time.Second)
			defer tick.Stop()
		dribble:
			for i := range frame {
				if _, err := c.Write(frame[i : i+1]); err != nil {
					break
				}
				select {
				case <-done: // cut off
					break dribble
				case <-tick.C:
				}
			}
			<-done
		}()
	}
	dribbling.Wait()
	// A normal tunnel during the attack.
	n, recvSum, err := transfer(e.dial(t, "sbx-during-slowloris", up.Addr()), size, 9)
	if err != nil {
		t.Errorf("tunnel during the attack: %v", err)
	}
	wg.Wait()
	close(read)
	for n := range read {
		if n != 0 {
			t.Errorf("a slow session read %d bytes; want none", n)
		}
	}
	waitRejections(t, "timeout", before+uint64(slow))
	checkTunnelTransfer(t, up, size, 9, n, recvSum)
	if up.Accepted() != 1 {
		t.Errorf("upstream accepted %d connections, want only the normal tunnel's", up.Accepted())
	}
	logged := 0
	for _, l := range e.logLines(t, "sandbox tunnel rejected") {
		if l["reason"] == "timeout" && l["peer"] != "" {
			logged++
		}
	}
	if logged != slow {
		t.Errorf("%d timeout log lines with a peer, want %d", logged, slow)
	}
	if stat, _ := since(); kernel && (stat["TlsTxSw"] != int64(slow)+1 || stat["TlsRxSw"] != int64(slow)+1 || stat["TlsDecryptError"] != 0) {
		t.Errorf("tls_stat delta %v: want TlsTxSw and TlsRxSw %d (every slow session and the normal tunnel offloaded), TlsDecryptError 0", stat, slow+1)
	}
}

// Peers that fail mutual TLS never reach the preamble parser: non-TLS
// bytes, no client certificate, a certificate of another CA, and one of
// the right CA that is not on the leaf allowlist. Each connection is
// closed without a tunnel byte, logged with the peer, counted as
// handshake-failed, and nothing is dialed.
func TestSandboxHandshakeRefusals(t *testing.T) { sandboxHandshakeRefusals(t, false) }

// TestKernelSandboxHandshakeRefusals is TestSandboxHandshakeRefusals on a
// kTLS kernel: a refused handshake installs nothing (tls_stat: no TX, no
// RX, no ULP error).
func TestKernelSandboxHandshakeRefusals(t *testing.T) {
	kerneltest.Require(t)
	sandboxHandshakeRefusals(t, true)
}

func sandboxHandshakeRefusals(t *testing.T, kernel bool) {
	up := forwardtest.NewUpstream(t, 0)
	e := newSandboxConfig(t, nil)
	e.cfg["logging"].(map[string]any)["logs"].(map[string]any)["default"].(map[string]any)["level"] = "DEBUG"
	e.start(t)
	forwardtest.CheckLeaks(t)
	since := dataPathDelta(t, kernel)
	outcomes0 := ktls.Stats().Outcomes
	stranger := e.ca.Client(t, "not-allowed")
	otherCA := testpki.NewCA(t, "other CA").Client(t, "gateway-1")
	tlsCase := func(leaf *testpki.Leaf) func(t *testing.T) {
		return func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			// A peer in crypto/tls, not a gateway's Dialer: one may have no
			// certificate, and a Dialer's own ktls.Client would add its
			// handshake to the process's offload outcomes checked below.
			cfg := e.tlsConfig(nil)
			if leaf != nil {
				// Sent whatever CAs the server names, as a hostile peer would
				// (Go's client sends only a certificate of a CA it asks for).
				cfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &leaf.TLS, nil }
			}
			c, err := tlsSend(ctx, e.addr, cfg, e.gw.Signer, preamble.Claims{SandboxID: "sbx", Target: up.Addr()})
			if err != nil {
				return // refused in the handshake
			}
			defer c.Close()
			// TLS 1.3: the client learns of the refusal on its first read.
			c.SetReadDeadline(time.Now().Add(10 * time.Second))
			if n, err := io.Copy(io.Discard, c); n != 0 || err == nil {
				t.Errorf("refused client read %d tunnel bytes and then err %v; want an error, no byte", n, err)
			}
		}
	}
	cases := []struct {
		name, reason string
		run          func(t *testing.T)
	}{
		{"non-tls", "not-tls", func(t *testing.T) {
			c, err := net.Dial("tcp", e.addr)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			c.Write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
			c.SetReadDeadline(time.Now().Add(10 * time.Second))
			if b, _ := io.ReadAll(c); len(b) > 0 && b[0] != 0x15 { // at most a TLS alert record
				t.Errorf("non-TLS client read %q", b)
			}
		}},
		{"no-client-certificate", "no-client-certificate", tlsCase(nil)},
		{"other-ca", "untrusted-certificate", tlsCase(otherCA)},
		{"not-on-allowlist", "certificate-not-allowed", tlsCase(stranger)},
	}
	failed := func() uint64 { return ktls.Stats().Outcomes[ktls.ReasonHandshakeFailed] }
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before, metrics0 := failed(), e.metrics(t)
			logged := len(e.logLines(t, "TLS handshake failed"))
			tc.run(t)
			waitUntil(t, 30*time.Second, func() bool {
				return failed() == before+1 && len(e.logLines(t, "TLS handshake failed")) == logged+1
			}, "one more failed handshake, counted and logged")
			// An unauthenticated peer owns no ERROR or WARN line of its own:
			// one DEBUG line with the peer and the reason, and a count.
			l := e.logLines(t, "TLS handshake failed")[logged]
			if l["level"] != "debug" || l["remote"] == "" || l["reason"] != tc.reason {
				t.Errorf("log line %v: want DEBUG, the peer and reason %q", l, tc.reason)
			}
			series := fmt.Sprintf("caddy_ktls_handshake_failures_total{module=%q,reason=%q}", moduleid.L4Handler, tc.reason)
			checkMetricDeltas(t, metrics0, e.metrics(t), map[string]int64{series: 1})
		})
	}
	if n := len(e.logLines(t, "handling connection")); n != 0 {
		t.Errorf("%d caddy-l4 ERROR lines for failed handshakes, want none", n)
	}
	// The failures within a minute share one WARN summary: the first.
	if w := e.logLines(t, offload.HandshakeFailureSummary); len(w) != 1 || w[0]["level"] != "warn" || w[0]["not-tls"] != float64(1) {
		t.Errorf("summaries %v: want one WARN, at the first failure (not-tls: 1)", w)
	}
	if up.Accepted() != 0 {
		t.Errorf("upstream dialed %d times for refused peers", up.Accepted())
	}
	if n := len(e.logLines(t, "sandbox tunnel rejected")); n != 0 {
		t.Errorf("%d refused peers reached the preamble parser", n)
	}
	metrics := string(e.adminBody(t, "/metrics"))
	l4Failed := offload.HandshakeOutcomeCounts()[offload.OutcomeKey{Module: moduleid.L4Handler, Reason: ktls.ReasonHandshakeFailed}]
	if line := fmt.Sprintf("%s %d\n", handshakeSeries(ktls.ReasonHandshakeFailed), l4Failed); !strings.Contains(metrics, line) {
		t.Errorf("/metrics lacks %q", line)
	}
	// No refused peer got an offload outcome of its own.
	for r, n := range ktls.Stats().Outcomes {
		want := outcomes0[r]
		if r == ktls.ReasonHandshakeFailed {
			want += uint64(len(cases))
		}
		if n != want {
			t.Errorf("handshakes with reason %s: %d -> %d, want %d", r, outcomes0[r], n, want)
		}
	}
	stat, dp := since()
	if dp != (forward.DataPath{}) {
		t.Errorf("data path %+v for refused peers, want nothing relayed", dp)
	}
	if kernel {
		for _, k := range []string{"TlsTxSw", "TlsRxSw", "TlsTxDevice", "TlsRxDevice", "TlsDecryptError"} {
			if stat[k] != 0 {
				t.Errorf("tls_stat delta %v: want %s 0 (a refused handshake installs nothing)", stat, k)
			}
		}
	}
}

// A client certificate outside the leaf allowlist is refused in the
// handshake: nothing is dialed.
func TestSandboxClientNotInAllowlist(t *testing.T) {
	up := forwardtest.NewUpstream(t, 0)
	e := newSandboxEnv(t, nil)
	// After Caddy started: what Caddy itself keeps (logs, admin) is not a
	// tunnel leak; everything the tunnels open must be gone again.
	forwardtest.CheckLeaks(t)
	stranger := e.ca.Client(t, "not-allowed")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := gatewayDial(ctx, e.addr, e.tlsConfig(stranger), e.gw.Signer, "sbx", up.Addr())
	if err == nil {
		// TLS 1.3: the client learns of the refusal on its first read.
		_, err = c.Read(make([]byte, 1))
		c.Close()
	}
	if err == nil {
		t.Fatal("a client outside the allowlist got through")
	}
	time.Sleep(100 * time.Millisecond)
	if up.Accepted() != 0 {
		t.Fatalf("upstream dialed %d times for a refused client", up.Accepted())
	}
}

// Every refusal: the connection is refused without a byte (the gateway
// reads the refusal: gateway.Refused on kTLS), ONE WARN log
// line names the reason, the peer and the cause, the reason's Prometheus
// series rises by one, nothing is dialed. The cases cover every preamble
// reason a gateway can cause (the spec's golden vectors for the wire
// rules, signed frames for validity, binding and replay) and every target
// the allowlist refuses (link-local, loopback in both families, this host's
// own address, a port), then dial failures (refused, blackholed).
func TestSandboxRejections(t *testing.T) { sandboxRejections(t, false) }

// TestKernelSandboxRejections is TestSandboxRejections on a kTLS kernel,
// where the preamble is read through kTLS RX (tls_stat proves each
// connection was offloaded before it was refused).
func TestKernelSandboxRejections(t *testing.T) {
	kerneltest.Require(t)
	sandboxRejections(t, true)
}

func sandboxRejections(t *testing.T, kernel bool) {
	// The allowlist holds every address, and opens loopback only for
	// 127.0.0.2, named exactly: there is what must be dialed (the replayed
	// frame's first use, the closed port, the blackhole), and up, which
	// refused tunnels name but must never reach. trap listens on every
	// local address: a dial to 127.0.0.1, ::1 or this host's own address
	// would land there.
	const opened = "127.0.0.2"
	up := forwardtest.NewUpstreamOn(t, opened+":0", 0)
	trap := forwardtest.NewUpstreamOn(t, ":0", 0)
	replayed := forwardtest.NewUpstreamOn(t, opened+":0", 0)
	closed := netip.MustParseAddrPort(freeAddr(t, opened))
	blackhole := forwardtest.Blackhole(t, netip.MustParseAddr(opened))
	var ports []string
	for _, a := range []netip.AddrPort{up.Addr(), trap.Addr(), replayed.Addr(), closed, blackhole} {
		ports = append(ports, fmt.Sprint(a.Port()))
	}
	e := newSandboxConfig(t, map[string]any{"preamble_timeout": "300ms", "dial_timeout": "1s",
		"allow_cidrs": []string{"0.0.0.0/0", "::/0", opened + "/32"}, "allow_ports": ports,
		"nat64_prefixes": []string{"2001:db8:64::/96"}})
	// A second key, bound to another gateway's certificate; the gateway's
	// own key is bound to its certificate (every accepted frame here shows
	// that the binding lets it through).
	boundElsewhere := forwardtest.NewGateway(t, "gw-bound")
	h := e.sandboxHandler()
	h["keys"] = append(h["keys"].([]any), map[string]any{"id": "gw-bound", "public_key": base64.StdEncoding.EncodeToString(boundElsewhere.Pub)})
	h["key_clients"] = map[string][]string{"gw-bound": {"other-gateway"}, gatewayKeyID: {"gateway-1"}}
	e.start(t)
	// After Caddy started: what Caddy itself keeps (logs, admin) is not a
	// tunnel leak; everything the tunnels open must be gone again.
	forwardtest.CheckLeaks(t)
	metrics0 := e.metrics(t)
	since := dataPathDelta(t, kernel)
	other := forwardtest.NewGateway(t, "gw-1")
	unknown := forwardtest.NewGateway(t, "gw-2")
	sessions := 0 // mTLS sessions opened
	mtls := func(t *testing.T, payload []byte, halfClose bool) *tls.Conn {
		sessions++
		return e.rawTunnel(t, payload, halfClose)
	}
	to := func(target netip.AddrPort) func(t *testing.T) *tls.Conn {
		return func(t *testing.T) *tls.Conn { return mtls(t, e.gw.Frame(t, "sbx", target), false) }
	}
	trapped := func(addr func(testing.TB) netip.Addr) func(t *testing.T) *tls.Conn {
		return func(t *testing.T) *tls.Conn { return to(netip.AddrPortFrom(addr(t), trap.Addr().Port()))(t) }
	}
	ip := func(s string) func(testing.TB) netip.Addr {
		return func(testing.TB) netip.Addr { return netip.MustParseAddr(s) }
	}
	signed := func(c preamble.Claims) func(t *testing.T) *tls.Conn {
		return func(t *testing.T) *tls.Conn {
			c.SandboxID, c.Target = "sbx", up.Addr()
			return mtls(t, e.gw.Sign(t, c), false)
		}
	}
	golden := func(name string) func(t *testing.T) *tls.Conn {
		return func(t *testing.T) *tls.Conn { return mtls(t, goldenFrame(t, name), false) }
	}
	// How the pipelined case's tenant write ended: in userspace TLS the
	// refusal is a reset, and when the write meets it first the kernel
	// reports it there once, so the read that follows ends at EOF.
	var pipelinedWriteErr error
	now := time.Now()
	cases := []struct {
		reason, what string
		cause        string // in the logged error
		open         func(t *testing.T) *tls.Conn
	}{
		{"bad-signature", "", "", func(t *testing.T) *tls.Conn { return mtls(t, other.Frame(t, "sbx", up.Addr()), false) }},
		{"unknown-key", "", "", func(t *testing.T) *tls.Conn { return mtls(t, unknown.Frame(t, "sbx", up.Addr()), false) }},
		{"bad-magic", "", "", func(t *testing.T) *tls.Conn { return mtls(t, []byte("SSH-2.0-OpenSSH_9.6\r\n"), false) }},
		{"timeout", "", "", func(t *testing.T) *tls.Conn { return mtls(t, e.gw.Frame(t, "sbx", up.Addr())[:12], false) }},
		{"truncated", "", "", func(t *testing.T) *tls.Conn { return mtls(t, e.gw.Frame(t, "sbx", up.Addr())[:12], true) }},
		{"bad-version", "", "", golden("reject-bad-version")},
		{"oversized", "", "", golden("reject-oversized")},
		{"malformed", "", "", golden("reject-malformed")},
		{"trailing-bytes", "", "", golden("reject-trailing-bytes")},
		{"bad-key-id", "", "", golden("reject-bad-key-id")},
		{"bad-sandbox-id", "", "", golden("reject-bad-sandbox-id")},
		{"bad-target", "", "", golden("reject-bad-target")},
		{"bad-target", "nat64-u-octet", "u octet", golden("reject-bad-target-nat64-u-octet")},
		{"bad-extension", "", "", golden("reject-bad-extension")},
		{"bad-extension", "client-identity-bidi", "bidirectional formatting character U+202E", golden("reject-bad-extension-client-identity-bidi-override")},
		{"unknown-critical-extension", "", "", golden("reject-unknown-critical-extension")},
		{"expired", "", "", signed(preamble.Claims{IssuedAt: now.Add(-10 * time.Minute), ExpiresAt: now.Add(-9 * time.Minute)})},
		{"not-yet-valid", "", "", signed(preamble.Claims{IssuedAt: now.Add(9 * time.Minute), ExpiresAt: now.Add(10 * time.Minute)})},
		{"ttl-too-long", "", "", signed(preamble.Claims{ExpiresAt: now.Add(time.Hour)})},
		{"binding-mismatch", "", "", signed(preamble.Claims{Binding: make([]byte, preamble.BindingLen)})},
		{"replayed-nonce", "", "", func(t *testing.T) *tls.Conn {
			frame := e.gw.Frame(t, "sbx", replayed.Addr())
			sessions++
			e.emptyTunnel(t, frame) // accepted: its nonce is now known
			return mtls(t, frame, false)
		}},
		{"target-denied", "metadata", "is link-local", trapped(ip("169.254.169.254"))},
		{"target-denied", "loopback", "is loopback", trapped(ip("127.0.0.1"))},
		{"target-denied", "loopback6", "is loopback", trapped(ip("::1"))},
		{"target-denied", "host-address", "is host interface address", trapped(forwardtest.HostAddress)},
		// Addresses that reach 169.254.169.254 or 127.0.0.1 through a
		// translator or a tunnel, under ::/0 (#31 item 1): the /48 reading
		// of the NAT64 local-use prefix behind a suffix that reads
		// 10.1.2.3, SIIT, 6to4, and the declared NAT64 prefix (nat64_prefixes),
		// without which that address would be plain IPv6.
		{"target-denied", "nat64-local-use", "reaches 169.254.169.254 as NAT64 in 64:ff9b:1::/48 (the /48 reading)", trapped(ip("64:ff9b:1:a9fe:a9:fe00:a01:203"))},
		{"target-denied", "siit", "reaches 169.254.169.254 as SIIT", trapped(ip("::ffff:0:a9fe:a9fe"))},
		{"target-denied", "6to4", "reaches 127.0.0.1 as 6to4", trapped(ip("2002:7f00:1::1"))},
		{"target-denied", "nat64-declared", "reaches 127.0.0.1 as NAT64 in the declared prefix 2001:db8:64::/96", trapped(ip("2001:db8:64::7f00:1"))},
		{"target-denied", "port", "not in the allowed ports", to(netip.AddrPortFrom(up.Addr().Addr(), 1))},
		{"target-denied", "pipelined", "not in the allowed ports", func(t *testing.T) *tls.Conn {
			// A gateway writes its tenant's first bytes right behind the
			// frame: the forwarder closes with them unread (a reset
			// follows), and the refusal must still arrive ahead of it.
			c := mtls(t, e.gw.Frame(t, "sbx", netip.AddrPortFrom(up.Addr().Addr(), 1)), false)
			_, pipelinedWriteErr = io.Copy(c, io.LimitReader(forwardtest.NewPattern(12), 48<<10))
			return c
		}},
		{"key-not-for-client", "", "key gw-bound is bound to [other-gateway], the client's certificate names [gateway-1]", func(t *testing.T) *tls.Conn {
			return mtls(t, boundElsewhere.Frame(t, "sbx", up.Addr()), false)
		}},
		{"dial-failed", "refused", "connection refused", to(closed)},
		{"dial-failed", "blackhole", "i/o timeout", to(blackhole)},
		{"binding-required", "", "", func(t *testing.T) *tls.Conn {
			// Last: from here on the configuration requires channel binding.
			e.sandboxHandler()["require_channel_binding"] = true
			e.load(t)
			return to(up.Addr())(t)
		}},
	}
	want := map[string]int{}
	for i, tc := range cases {
		name := fmt.Sprintf("%d-%s", i, tc.reason)
		if tc.what != "" {
			name += "-" + tc.what
		}
		t.Run(name, func(t *testing.T) {
			before := forwarder.Tunnels().RefusedTunnels()[tc.reason]
			logged := len(e.logLines(t, rejectedMsg))
			pipelinedWriteErr = nil
			c := tc.open(t)
			defer c.Close()
			c.SetReadDeadline(time.Now().Add(10 * time.Second))
			n, err := io.Copy(io.Discard, c)
			if n != 0 {
				t.Errorf("refused client read %d bytes (err %v); want none", n, err)
			}
			if !kernel && err == nil && pipelinedWriteErr != nil {
				err = pipelinedWriteErr
			}
			checkGatewayEnd(t, err, kernel, true)
			waitRejections(t, tc.reason, before+1)
			want[tc.reason]++
			l := e.waitLogLine(t, rejectedMsg, logged)
			if l["level"] != "warn" || l["reason"] != tc.reason || l["peer"] != c.LocalAddr().String() ||
				l["client_certificate"] != gatewaySubject || !strings.Contains(fmt.Sprint(l["error"]), tc.cause) {
				t.Errorf("log line %v: want a WARN with reason %q, peer %s, client_certificate %s and an error saying %q",
					l, tc.reason, c.LocalAddr(), gatewaySubject, tc.cause)
			}
		})
	}
	if up.Accepted() != 0 || trap.Accepted() != 0 || replayed.Accepted() != 1 {
		t.Errorf("refused tunnels dialed: upstream %d times, trap %d times, replayed frame's target %d times (want 0, 0, 1: its first use)",
			up.Accepted(), trap.Accepted(), replayed.Accepted())
	}
	if stat, dp := since(); kernel && (stat["TlsRxSw"] < int64(sessions) || stat["TlsTxSw"] < int64(sessions) ||
		stat["TlsDecryptError"] != 0 || dp.SpliceBytes+dp.CopyBytes != 0) {
		t.Errorf("tls_stat delta %v, data path %+v: want all %d sessions offloaded TX and RX, no decrypt error, no byte relayed", stat, dp, sessions)
	}
	// One line per refusal, none for anything else.
	got := map[string]int{}
	for _, l := range e.logLines(t, rejectedMsg) {
		reason, _ := l["reason"].(string)
		got[reason]++
	}
	if !maps.Equal(got, want) {
		t.Errorf("log lines by reason %v, want %v", got, want)
	}
	// Prometheus, through the admin endpoint: every reason has a series
	// from the start, and each rose by its refusals.
	for _, r := range forwarder.RefusalReasons() {
		if _, ok := metrics0[rejectSeries(r)]; !ok {
			t.Errorf("/metrics has no series %s before any refusal for it", rejectSeries(r))
		}
	}
	deltas := map[string]int64{}
	for r, n := range want {
		deltas[rejectSeries(r)] = int64(n)
	}
	checkMetricDeltas(t, metrics0, e.metrics(t), deltas)
}

func rejectSeries(reason string) string {
	return fmt.Sprintf("caddy_ktls_sandbox_rejects_total{reason=%q}", reason)
}

// goldenFrame is one of the preamble spec's vectors (preamble/testdata,
// docs/preamble.md). Each reject vector breaks one rule; the wire rules are
// checked before the key is looked up, so the vectors' example key, unknown
// here, does not change their reason.
func goldenFrame(t *testing.T, name string) []byte {
	t.Helper()
	text, err := os.ReadFile(filepath.Join("preamble", "testdata", name+".hex"))
	if err == nil {
		var frame []byte
		if frame, err = hex.DecodeString(strings.TrimSpace(string(text))); err == nil {
			return frame
		}
	}
	t.Fatalf("golden vector %s: %v", name, err)
	return nil
}

// A sandbox handler whose route verifies no client certificate carries
// nothing: behind caddy-l4's `tls` handler without client authentication,
// and behind `ktls` whose client_auth takes the certificate without
// verifying its chain (mode require), every connection is refused with
// no-client-certificate before its preamble is read. Each refusal is one
// DEBUG line naming the peer (and the unverified certificate, where one
// came), the first of each configuration a WARN summary (anyone who
// reaches the port can cause it: TestSandboxAnonymousRejectSummary), the
// reason's series rises by one, the gateway reads a refusal end, and
// nothing is dialed.
func TestSandboxUnverifiedClientRefused(t *testing.T) { sandboxUnverifiedClientRefused(t, false) }

// TestKernelSandboxUnverifiedClientRefused is TestSandboxUnverifiedClientRefused
// on a kTLS kernel, where the ktls case is offloaded and refused with the
// access_denied alert.
func TestKernelSandboxUnverifiedClientRefused(t *testing.T) {
	kerneltest.Require(t)
	sandboxUnverifiedClientRefused(t, true)
}

func sandboxUnverifiedClientRefused(t *testing.T, kernel bool) {
	const reason = string(forward.ReasonNoClientCertificate)
	up := forwardtest.NewUpstream(t, 0)
	e := newSandboxConfig(t, nil)
	route := e.route()
	handlers := route["handle"].([]any)
	ktlsHandler, sandbox := handlers[0].(map[string]any), handlers[1]
	// caddy-l4's own TLS handler, which asks for no client certificate.
	route["handle"] = []any{map[string]any{"handler": "tls", "connection_policies": []any{map[string]any{"default_sni": "localhost"}}}, sandbox}
	e.cfg["logging"].(map[string]any)["logs"].(map[string]any)["default"].(map[string]any)["level"] = "DEBUG"
	e.start(t)
	forwardtest.CheckLeaks(t)
	metrics0 := e.metrics(t)
	cases := []struct {
		name      string
		configure func(t *testing.T)
		cert      string // client_certificate in the log line
		alert     bool   // the refusal goes through a ktls.Conn: the access_denied alert
	}{
		// caddy-l4's tls handler's crypto/tls conn cannot send an alert of
		// the forwarder's choosing: the refusal is a reset.
		{"tls-handler-without-client-auth", func(*testing.T) {}, "", false},
		{"ktls-client-auth-require-unverified", func(t *testing.T) {
			// The listed gateway certificate, taken as sent: crypto/tls
			// verifies no chain in mode require (the leaf verifier still
			// checks it is listed), so the session has no verified chain.
			policy := ktlsHandler["connection_policies"].([]any)[0].(map[string]any)
			policy["client_authentication"].(map[string]any)["mode"] = "require"
			route["handle"] = []any{ktlsHandler, sandbox}
			e.load(t)
		}, gatewaySubject, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tc.configure(t)
			before := forwarder.Tunnels().RefusedTunnels()[reason]
			logged := len(e.logLines(t, rejectedMsg))
			c, err := tls.Dial("tcp", e.addr, e.tlsConfig(e.client))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			_, werr := c.Write(e.gw.Frame(t, "sbx-unverified", up.Addr()))
			c.SetReadDeadline(time.Now().Add(10 * time.Second))
			n, err := io.Copy(io.Discard, c)
			err = sockerr.ReadError(c, err)
			if n != 0 {
				t.Errorf("refused client read %d bytes (err %v); want none", n, err)
			}
			// Refused before anything is read: in userspace TLS the reset
			// can meet the frame's write first, which then reports it, and
			// the read that follows ends at EOF.
			if !tc.alert && err == nil && werr != nil {
				err = werr
			}
			if tc.alert {
				checkGatewayEnd(t, err, kernel, true)
			} else if !errors.Is(err, syscall.ECONNRESET) {
				t.Errorf("the gateway's read ended with %v, want a reset", err)
			}
			waitRejections(t, reason, before+1)
			l := e.waitLogLine(t, rejectedMsg, logged)
			if l["level"] != "debug" || l["reason"] != reason || l["peer"] != c.LocalAddr().String() ||
				l["client_certificate"] != tc.cert || !strings.Contains(fmt.Sprint(l["error"]), "no verified client certificate") {
				t.Errorf("log line %v: want a DEBUG line with reason %s, peer %s, client_certificate %q and the cause",
					l, reason, c.LocalAddr(), tc.cert)
			}
		})
	}
	if up.Accepted() != 0 {
		t.Errorf("upstream dialed %d times for unauthenticated clients", up.Accepted())
	}
	got := map[string]int{}
	for _, l := range e.logLines(t, rejectedMsg) {
		r, _ := l["reason"].(string)
		got[r]++
	}
	if !maps.Equal(got, map[string]int{reason: len(cases)}) {
		t.Errorf("log lines by reason %v, want %d %s", got, len(cases), reason)
	}
	// Each case runs under a configuration of its own: each summary is
	// its configuration's first.
	if w := e.logLines(t, forwarder.AnonymousRefusalSummary); len(w) != len(cases) || w[0]["level"] != "warn" || w[0]["first"] != true || w[0][reason] != 1.0 {
		t.Errorf("summaries %v, want %d WARNs, each the first of its configuration with %s 1", w, len(cases), reason)
	}
	checkMetricDeltas(t, metrics0, e.metrics(t), map[string]int64{rejectSeries(reason): int64(len(cases))})
}

// insecure_plaintext, the test-only escape hatch: a route with `sandbox`
// alone carries a tunnel whose preamble comes in plaintext over raw TCP,
// exact bytes both ways, and every load says at WARN what it turned off.
func TestSandboxInsecurePlaintext(t *testing.T) {
	const size, seed = 1 << 20, 21
	up := forwardtest.NewUpstream(t, size+3)
	e := newSandboxConfig(t, map[string]any{"insecure_plaintext": true})
	route := e.route()
	route["handle"] = []any{e.sandboxHandler()} // no TLS handler
	e.start(t)
	forwardtest.CheckLeaks(t)
	rejected := forwarder.Tunnels().RefusedTunnels()

	c, err := net.Dial("tcp", e.addr)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write(e.gw.Frame(t, "sbx-plaintext", up.Addr())); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(time.Minute))
	n, recvSum, err := transfer(c.(*net.TCPConn), size, seed)
	if err != nil {
		t.Fatalf("plaintext tunnel: %v", err)
	}
	checkTunnelTransfer(t, up, size, seed, n, recvSum)
	if now := forwarder.Tunnels().RefusedTunnels(); !maps.Equal(now, rejected) {
		t.Errorf("rejections changed from %v to %v", rejected, now)
	}
	checkWarned := func(loads int) {
		t.Helper()
		lines := e.logLines(t, forwarder.InsecurePlaintextWarning)
		if len(lines) != loads {
			t.Fatalf("%d insecure_plaintext warnings after %d loads, want one per load", len(lines), loads)
		}
		for _, l := range lines {
			if l["level"] != "warn" {
				t.Errorf("insecure_plaintext logged %v, want a WARN", l)
			}
		}
	}
	checkWarned(1)
	e.load(t)
	checkWarned(2)
}
