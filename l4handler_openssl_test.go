package caddyktls

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/sockerr"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// These tests put OpenSSL in the gateway's seat: testdata/ossl_gateway.py
// drives libssl through ctypes (`openssl s_client` cannot write the binary
// preamble and later send a KeyUpdate; see the script). The target echoes,
// and the gateway waits for the echo of each block before its next step, so
// every KeyUpdate, close_notify or bad record reaches the forwarder while
// its relay is splicing, between records it has already moved.

// echoResult is what echoUpstream's one connection saw.
type echoResult struct {
	n   int64
	sum string // hex SHA-256 of the bytes, as the gateway reports its own
	err error
}

// echoUpstream accepts one connection and sends back everything it
// receives until EOF, then half-closes; it reports the bytes it echoed.
func echoUpstream(t *testing.T) (netip.AddrPort, <-chan echoResult) {
	t.Helper()
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	done := make(chan echoResult, 1)
	go func() {
		c, err := ln.AcceptTCP()
		ln.Close()
		if err != nil {
			done <- echoResult{err: err}
			return
		}
		defer c.Close()
		h := sha256.New()
		n, err := io.Copy(io.MultiWriter(c, h), c)
		err = sockerr.ReadError(c, err)
		c.CloseWrite()
		done <- echoResult{n: n, sum: hex.EncodeToString(h.Sum(nil)), err: err}
	}()
	return ln.Addr().(*net.TCPAddr).AddrPort(), done
}

const (
	controlRecordsSeries   = "caddy_ktls_relay_control_records_total"
	rateLimitedSeries      = `caddy_ktls_connections_closed_total{event="rate-limited",module="layer4.handlers.ktls"}`
	rekeyUnsupportedSeries = `caddy_ktls_connections_closed_total{event="rekey-unsupported",module="layer4.handlers.ktls"}`
	badRecordSeries        = `caddy_ktls_connections_closed_total{event="bad-record",module="layer4.handlers.ktls"}`
)

// keyUpdateBlock is the size of each block the gateway writes and waits to
// get back between two KeyUpdates: small enough that a blocking write never
// waits on its own unread echo.
const keyUpdateBlock = 128 << 10

// TestSandboxOpenSSLKeyUpdate: OpenSSL as the gateway sends KeyUpdates,
// with and without update_requested, between blocks of a tunnel, then
// close_notify. On the userspace path (no kTLS here) Go's crypto/tls
// handles them; every byte must come back unchanged.
func TestSandboxOpenSSLKeyUpdate(t *testing.T) { sandboxOpenSSLKeyUpdate(t, false) }

// TestKernelSandboxOpenSSLKeyUpdate is TestSandboxOpenSSLKeyUpdate on a kTLS
// kernel. With rekey (Linux >= 6.14) each KeyUpdate is received as a control
// record in userspace, the new RX key goes into the kernel and splicing
// resumes; a requested update is answered with the forwarder's own
// KeyUpdate and a new kernel TX key, under which the echo must still
// decrypt at OpenSSL. Without rekey the first KeyUpdate ends the tunnel
// with ErrRekeyUnsupported: an internal_error alert to the gateway, a reset
// to the sandbox, nothing lost before it.
func TestKernelSandboxOpenSSLKeyUpdate(t *testing.T) {
	kerneltest.Require(t)
	sandboxOpenSSLKeyUpdate(t, true)
}

func sandboxOpenSSLKeyUpdate(t *testing.T, kernel bool) {
	// Userspace TLS always takes KeyUpdates; the kernel from 6.14 on.
	rekey := !kernel || ktls.Probe().Rekey // before CheckLeaks: the probe is cached for the process
	steps := []string{
		"data:" + strconv.Itoa(keyUpdateBlock), "ku:req",
		"data:" + strconv.Itoa(keyUpdateBlock), "ku:noreq",
		"data:" + strconv.Itoa(keyUpdateBlock), "ku:req", "ku:noreq",
		"data:" + strconv.Itoa(keyUpdateBlock), "ku:req",
		"data:" + strconv.Itoa(keyUpdateBlock), "close",
	}
	const keyUpdates, keyUpdatePlaces, requested, total = 5, 4, 3, 5 * keyUpdateBlock
	if !rekey {
		// The first KeyUpdate ends the tunnel: the gateway stops writing
		// there and reads how (more bytes behind the KeyUpdate would still
		// be unread when the forwarder closes, and TCP would reset the
		// connection, alert and all).
		steps = append(steps[:2:2], "wait")
	}
	target, echoed := echoUpstream(t)
	sandbox := uniqueSandbox("sbx-openssl-keyupdate")
	e := newSandboxEnv(t, nil)
	forwardtest.CheckLeaks(t)
	controls0 := e.metric(t, controlRecordsSeries)
	since := dataPathDelta(t, kernel)

	gw := e.opensslGateway(t, sandbox, target, steps...)
	up := <-echoed
	waitIdle(t)
	stat, dp := since()
	t.Logf("rekey=%v tls_stat delta %v; data path %+v; upstream echoed %d bytes (%v)", rekey, stat, dp, up.n, up.err)
	if gw.Version != "TLSv1.3" {
		t.Fatalf("OpenSSL negotiated %s, want TLSv1.3 (KeyUpdate is TLS 1.3's)", gw.Version)
	}
	// Without rekey the tunnel fails at the KeyUpdate, and the sandbox's
	// connection is reset behind the bytes before it.
	if (rekey && up.err != nil) || (!rekey && !errors.Is(up.err, syscall.ECONNRESET)) || up.n != gw.Received || up.sum != gw.ReceivedSHA256 {
		t.Errorf("upstream echoed %d bytes (%v), the gateway got back %d: hashes match %v", up.n, up.err, gw.Received, up.sum == gw.ReceivedSHA256)
	}
	if kernel && stat["TlsDecryptError"] != 0 {
		t.Errorf("tls_stat delta %v: want TlsDecryptError 0", stat)
	}

	if !rekey {
		// The tunnel carried the first block, then the KeyUpdate ended it:
		// the forwarder reported why with an alert and closed both sides.
		if gw.Error != "" || gw.StepsDone != len(steps) || gw.Sent != keyUpdateBlock || gw.Received != keyUpdateBlock ||
			gw.SentSHA256 != gw.ReceivedSHA256 || !strings.Contains(gw.End, "alert internal error") {
			t.Errorf("gateway %+v: want the first block echoed, the KeyUpdate sent, then the forwarder's internal_error alert", gw)
		}
		if got := e.waitTunnelEndError(t, sandbox); !strings.Contains(got, ktls.ErrRekeyUnsupported.Error()) {
			t.Errorf("tunnel end logged with error %q, want %q", got, ktls.ErrRekeyUnsupported)
		}
		return
	}
	if gw.Error != "" || gw.StepsDone != len(steps) || gw.KeyUpdates != keyUpdates {
		t.Fatalf("gateway %+v: want all %d steps and %d KeyUpdates", gw, len(steps), keyUpdates)
	}
	if gw.Sent != total || gw.Received != total || gw.SentSHA256 != gw.ReceivedSHA256 {
		t.Errorf("gateway sent %d and got back %d bytes, want %d both ways, same hash", gw.Sent, gw.Received, total)
	}
	if gw.End != "close_notify" {
		t.Errorf("the gateway's tunnel ended with %q, want the forwarder's close_notify", gw.End)
	}
	if got := e.tunnelEndError(t, sandbox); got != "" {
		t.Errorf("tunnel ended with error %q", got)
	}
	if !kernel {
		return
	}
	if stat["TlsRxRekeyOk"] < keyUpdates || stat["TlsTxRekeyOk"] < requested || stat["TlsRxRekeyError"] != 0 {
		t.Errorf("tls_stat delta %v: want TlsRxRekeyOk >= %d, TlsTxRekeyOk >= %d, TlsRxRekeyError 0", stat, keyUpdates, requested)
	}
	// splice(2) refuses the record at the head of the queue once at each
	// place a KeyUpdate (or two back to back) and the close_notify stand;
	// the source's Read then handles them in userspace, and may go on to
	// return data behind them, which is copied: at most one copy buffer
	// (splice's 32 KiB) per refusal. Everything else is spliced.
	if dp.ControlRecords < keyUpdatePlaces+1 {
		t.Errorf("relay handed %d control records to userspace, want >= %d (KeyUpdates at %d places, close_notify)", dp.ControlRecords, keyUpdatePlaces+1, keyUpdatePlaces)
	}
	if got := e.metric(t, controlRecordsSeries) - controls0; got != dp.ControlRecords {
		t.Errorf("%s rose by %d, the registry by %d", controlRecordsSeries, got, dp.ControlRecords)
	}
	if dp.SpliceBytes+dp.CopyBytes != 2*total || dp.CopyBytes > dp.ControlRecords*(32<<10) {
		t.Errorf("data path %+v: want %d bytes, all spliced but at most 32 KiB after each control record", dp, 2*total)
	}
}

// TestSandboxBadRecord: after a block, the gateway writes a record the
// forwarder cannot decrypt (garbage where the AEAD tag should be). The
// tunnel ends with an error on both sides, the sandbox sees its connection
// reset after exactly the bytes before the bad record (the stream it got is
// cut, not complete), nothing leaks.
func TestSandboxBadRecord(t *testing.T) { sandboxBadRecord(t, false) }

// TestKernelSandboxBadRecord is TestSandboxBadRecord on a kTLS kernel: the
// kernel fails the record (EBADMSG, counted in TlsDecryptError).
func TestKernelSandboxBadRecord(t *testing.T) {
	kerneltest.Require(t)
	sandboxBadRecord(t, true)
}

func sandboxBadRecord(t *testing.T, kernel bool) {
	target, echoed := echoUpstream(t)
	sandbox := uniqueSandbox("sbx-bad-record")
	e := newSandboxEnv(t, nil)
	forwardtest.CheckLeaks(t)
	since := dataPathDelta(t, kernel)
	before := e.metrics(t)
	gw := e.opensslGateway(t, sandbox, target, "data:"+strconv.Itoa(keyUpdateBlock), "badrecord", "wait")
	up := <-echoed
	waitIdle(t)
	logged := e.waitTunnelEndError(t, sandbox)
	stat, dp := since()
	// Counted once, as a bad record and nothing else.
	checkMetricDeltas(t, before, e.metrics(t), map[string]int64{badRecordSeries: 1, rekeyUnsupportedSeries: 0,
		`caddy_ktls_connections_closed_total{event="alert",module="layer4.handlers.ktls"}`: 0})
	t.Logf("tls_stat delta %v; data path %+v", stat, dp)
	if gw.Received != keyUpdateBlock || !errors.Is(up.err, syscall.ECONNRESET) || up.n != keyUpdateBlock || up.sum != gw.ReceivedSHA256 {
		t.Errorf("gateway %+v, upstream echoed %d bytes (%v): want the block before the bad record, and no more, both ways, then a reset", gw, up.n, up.err)
	}
	if gw.End == "" || gw.End == "close_notify" {
		t.Errorf("the gateway's tunnel ended with %q, want an error or EOF (the forwarder failed it)", gw.End)
	}
	if logged == "" {
		t.Errorf("no log line says the tunnel of %s ended with an error", sandbox)
	}
	// splice(2) fails with EBADMSG once and the relay ends the tunnel: the
	// record is not handed to the conn's Read, which would fail on it (and
	// count it) a second time.
	if kernel && (stat["TlsDecryptError"] != 1 || !strings.Contains(logged, syscall.EBADMSG.Error())) {
		t.Errorf("tls_stat delta %v, tunnel error %q: want TlsDecryptError 1 and EBADMSG", stat, logged)
	}
}

// internalErrorAlert is the alert description the gateway sends in the
// peer-alert tests (internal_error).
const internalErrorAlert = 80

// TestSandboxPeerAlert: after a block, the gateway sends a fatal alert
// (internal_error) in the middle of the tunnel. The tunnel ends with an
// error that names the alert, the sandbox sees its connection reset after
// exactly the block, the gateway's connection is closed, nothing leaks.
func TestSandboxPeerAlert(t *testing.T) { sandboxPeerAlert(t, false) }

// TestKernelSandboxPeerAlert is TestSandboxPeerAlert on a kTLS kernel:
// splice(2) stops at the alert record, the relay hands it to the conn's
// userspace read, which reports it: caddy_ktls_connections_closed_total
// {event="alert"} counts it.
func TestKernelSandboxPeerAlert(t *testing.T) {
	kerneltest.Require(t)
	sandboxPeerAlert(t, true)
}

func sandboxPeerAlert(t *testing.T, kernel bool) {
	const alertSeries = `caddy_ktls_connections_closed_total{event="alert",module="layer4.handlers.ktls"}`
	target, echoed := echoUpstream(t)
	sandbox := uniqueSandbox("sbx-peer-alert")
	e := newSandboxEnv(t, nil)
	forwardtest.CheckLeaks(t)
	since := dataPathDelta(t, kernel)
	alerts0 := e.metric(t, alertSeries)
	steps := []string{"data:" + strconv.Itoa(keyUpdateBlock), "alert:" + strconv.Itoa(internalErrorAlert), "wait"}
	gw := e.opensslGateway(t, sandbox, target, steps...)
	up := <-echoed
	waitIdle(t)
	stat, dp := since()
	t.Logf("tls_stat delta %v; data path %+v", stat, dp)
	if gw.Error != "" || gw.StepsDone != len(steps) || gw.Received != keyUpdateBlock || gw.SentSHA256 != gw.ReceivedSHA256 {
		t.Errorf("gateway %+v: want the block echoed, the alert sent, then the connection closed", gw)
	}
	if !errors.Is(up.err, syscall.ECONNRESET) || up.n != keyUpdateBlock || up.sum != gw.ReceivedSHA256 {
		t.Errorf("upstream echoed %d bytes (%v): want exactly the block before the alert, then a reset", up.n, up.err)
	}
	if gw.End == "" {
		t.Errorf("the gateway's last read did not end: the forwarder kept the connection open")
	}
	// crypto/tls (the userspace path here) and the kernel path word it
	// differently; both name the alert.
	want := "remote error: tls: internal error"
	if kernel {
		want = ktls.AlertError(internalErrorAlert).Error()
	}
	if got := e.waitTunnelEndError(t, sandbox); !strings.Contains(got, want) {
		t.Errorf("tunnel end logged with error %q, want %q", got, want)
	}
	if !kernel {
		return
	}
	if got := e.metric(t, alertSeries) - alerts0; got != 1 {
		t.Errorf("%s rose by %d, want 1", alertSeries, got)
	}
	if dp.ControlRecords < 1 || stat["TlsDecryptError"] != 0 || dp.SpliceBytes == 0 {
		t.Errorf("data path %+v, tls_stat delta %v: want the block spliced, the alert handed to userspace, no decrypt error", dp, stat)
	}
}

// TestKernelSandboxKeyUpdateFlood: OpenSSL sends 1,000 KeyUpdates back to
// back, far above the default limit (10/s, burst 20). With rekey the
// forwarder installs the burst's keys, then closes the tunnel with
// ErrKeyUpdateRateLimited (and an unexpected_message alert); without, the
// first KeyUpdate closes it with ErrRekeyUnsupported. Either way the
// sandbox sees its connection reset, nothing leaks, and the next tunnel
// works.
func TestKernelSandboxKeyUpdateFlood(t *testing.T) {
	kerneltest.Require(t)
	sandboxKeyUpdateFlood(t, true)
}

// TestSandboxKeyUpdateFlood is the flood on the userspace fallback (no
// kTLS here), where crypto/tls, not the ktls engine, handles KeyUpdates:
// keyupdate_rate does not apply; crypto/tls ends the connection after 16
// records in a row that carry no data ("too many non-advancing records"),
// which no module series counts (docs/security.md, Known gaps).
func TestSandboxKeyUpdateFlood(t *testing.T) { sandboxKeyUpdateFlood(t, false) }

func sandboxKeyUpdateFlood(t *testing.T, kernel bool) {
	rekey := kernel && ktls.Probe().Rekey // before CheckLeaks: the probe is cached for the process
	const flood, burst = 1000, 20
	target, echoed := echoUpstream(t)
	sandbox := uniqueSandbox("sbx-keyupdate-flood")
	e := newSandboxEnv(t, nil)
	forwardtest.CheckLeaks(t)
	since := dataPathDelta(t, kernel)
	before := e.metrics(t)
	gw := e.opensslGateway(t, sandbox, target, "data:"+strconv.Itoa(keyUpdateBlock), "kuflood:"+strconv.Itoa(flood), "wait")
	up := <-echoed
	waitIdle(t)
	stat, dp := since()
	t.Logf("rekey=%v tls_stat delta %v; data path %+v", rekey, stat, dp)
	if gw.Received != keyUpdateBlock || !errors.Is(up.err, syscall.ECONNRESET) || up.n != keyUpdateBlock || up.sum != gw.ReceivedSHA256 {
		t.Errorf("gateway %+v, upstream echoed %d bytes (%v): want the block before the flood both ways, then a reset", gw, up.n, up.err)
	}
	if gw.End == "close_notify" || gw.KeyUpdates == 0 {
		t.Errorf("gateway %+v: want KeyUpdates sent and the tunnel failed", gw)
	}
	// On the kernel path the close is counted once, under its cause.
	want, closes := ktls.ErrRekeyUnsupported.Error(), map[string]int64{rateLimitedSeries: 0, rekeyUnsupportedSeries: 1, badRecordSeries: 0}
	switch {
	case !kernel:
		want, closes[rekeyUnsupportedSeries] = "tls: too many non-advancing records", 0
	case rekey:
		want, closes[rateLimitedSeries], closes[rekeyUnsupportedSeries] = ktls.ErrKeyUpdateRateLimited.Error(), 1, 0
		if stat["TlsRxRekeyOk"] < burst || stat["TlsRxRekeyOk"] >= flood || stat["TlsDecryptError"] != 0 {
			t.Errorf("tls_stat delta %v: want TlsRxRekeyOk from the burst (%d) to fewer than the %d sent, TlsDecryptError 0", stat, burst, flood)
		}
	}
	got := e.waitTunnelEndError(t, sandbox)
	checkMetricDeltas(t, before, e.metrics(t), closes)
	if !strings.Contains(got, want) {
		t.Errorf("tunnel end logged with error %q, want %q", got, want)
	}

	// The forwarder is fine: a second tunnel carries its bytes and closes cleanly.
	target, echoed = echoUpstream(t)
	next := uniqueSandbox("sbx-after-flood")
	gw = e.opensslGateway(t, next, target, "data:"+strconv.Itoa(keyUpdateBlock), "close")
	up = <-echoed
	waitIdle(t)
	if gw.Error != "" || gw.Received != keyUpdateBlock || gw.SentSHA256 != gw.ReceivedSHA256 || up.n != keyUpdateBlock || gw.End != "close_notify" {
		t.Errorf("tunnel after the flood: gateway %+v, upstream echoed %d bytes", gw, up.n)
	}
	if got := e.tunnelEndError(t, next); got != "" {
		t.Errorf("tunnel after the flood ended with error %q", got)
	}
}
