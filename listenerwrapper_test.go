package caddyktls

import (
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	_ "github.com/caddyserver/caddy/v2/modules/standard"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/internal/offload"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// lwScenario is the whole HTTP scenario for one wrapper mode.
// kernel says whether the connections must be offloaded (VM) or must fall
// back (host).
func lwScenario(t *testing.T, sendfile, kernel bool) {
	statsBefore := ktls.Stats()
	rfBefore := lwReadFromNow()
	s := lwStartSite(t, map[string]any{"sendfile": sendfile})
	var exercised int
	var tlsDelta kerneltest.Stat
	run := func() { exercised = s.exercise(t) }
	if kernel {
		tlsDelta = kerneltest.StatDelta(t, run)
	} else {
		run()
	}
	conns := exercised + 1 // and the readiness probe
	stats := ktls.Stats()
	rf := lwReadFromNow().sub(rfBefore)
	outcome := func(r ktls.Reason) uint64 { return stats.Outcomes[r] - statsBefore.Outcomes[r] }
	// One connection is refused in the handshake (client auth without a
	// certificate); every other one reports its outcome.
	offloaded := conns - 1
	if kernel {
		if got := outcome(ktls.ReasonNone); got < uint64(offloaded) {
			t.Errorf("fully offloaded handshakes: %d, want >= %d (outcomes %v)", got, offloaded, stats.Outcomes)
		}
		// The kernel counts the sockets that got TX and RX keys while the
		// checks ran (the probe connection was before).
		if want := int64(exercised - 1); tlsDelta["TlsTxSw"] < want || tlsDelta["TlsRxSw"] < want {
			t.Errorf("tls_stat delta %v: want TlsTxSw and TlsRxSw >= %d", tlsDelta, want)
		}
	} else if got := outcome(ktls.ReasonNoKernelSupport); got < uint64(offloaded) {
		t.Errorf("fallbacks for no-kernel-support: %d, want >= %d (outcomes %v)", got, offloaded, stats.Outcomes)
	}
	// http.response.ReadFrom copies the first 512 bytes itself (sniffing).
	minBody := uint64(len(s.file) - 512)
	// sendfile is in effect only where TX can be in the kernel: without
	// kTLS the wrapper does without it (bodies are copied either way).
	inEffect := sendfile && kernel
	if inEffect {
		if rf.sendfileBytes < minBody {
			t.Errorf("ReadFrom sendfile path moved %d bytes, want >= %d (totals %+v)", rf.sendfileBytes, minBody, rf)
		}
		if rf.copyBytes != 0 {
			t.Errorf("file body copied through userspace on a kTLS connection: %+v", rf)
		}
	} else if rf != (lwReadFromTotals{}) {
		t.Errorf("ReadFrom reached without sendfile in effect (sendfile %v, kernel TLS %v): %+v", sendfile, kernel, rf)
	}
	// Logs: the start summary, one debug line per handshake, and Caddy's
	// per-connection WARN exactly when sendfile is in effect: never on a
	// host without kTLS.
	if n := len(s.logLines(t, "kernel TLS ")); n == 0 {
		t.Error("no kernel TLS log lines")
	}
	summary := "kernel TLS unavailable"
	if kernel {
		summary = "kernel TLS available"
	}
	if len(s.logLines(t, summary)) == 0 {
		t.Errorf("no %q summary at start", summary)
	}
	handshakes := s.logLines(t, "kernel TLS handshake")
	if len(handshakes) < offloaded {
		t.Errorf("%d handshake debug lines, want >= %d", len(handshakes), offloaded)
	}
	warns := len(s.logLines(t, lwStaterWarning))
	if inEffect && warns < offloaded {
		t.Errorf("sendfile mode: %d Caddy connectionStater warnings, want one per connection (%d): has Caddy changed?", warns, offloaded)
	}
	if !inEffect && warns != 0 {
		t.Errorf("sendfile %v, kernel TLS %v: %d Caddy connectionStater warnings, want none (no WARN per connection where sendfile cannot help)", sendfile, kernel, warns)
	}
	if sendfile && !kernel {
		lines := s.logLines(t, summary)
		if len(lines) != 1 || lines[0]["sendfile"] != false || lines[0]["sendfile_off"] == nil {
			t.Errorf("start lines %v: want one, saying sendfile is off here and why", lines)
		}
	}
}

// TestListenerWrapperFallback serves HTTP/1.1 and HTTP/2 through the
// wrapper on a kernel without kTLS: every connection falls back to
// userspace TLS and everything still works. With KTLS_REQUIRE=1 (the VM)
// it is the kernel tests' job, so it only runs where kTLS is absent.
func TestListenerWrapperFallback(t *testing.T) {
	if kerneltest.Available() == nil {
		t.Skip("kTLS is available here: TestKernelListenerWrapper covers this kernel")
	}
	for _, sendfile := range []bool{false, true} {
		t.Run("sendfile="+strconv.FormatBool(sendfile), func(t *testing.T) {
			lwScenario(t, sendfile, false)
		})
	}
}

// TestKernelListenerWrapper is the same scenario on a kTLS kernel: every
// connection must be offloaded (tls_stat moves), and in sendfile mode file
// bodies must leave through the sendfile path.
func TestKernelListenerWrapper(t *testing.T) {
	kerneltest.Require(t)
	for _, sendfile := range []bool{false, true} {
		t.Run("sendfile="+strconv.FormatBool(sendfile), func(t *testing.T) {
			lwScenario(t, sendfile, true)
		})
	}
}

// TestListenerWrapperReload reloads the configuration through the admin
// API while an HTTP/1.1 and an HTTP/2 download are in the middle of their
// responses: both complete intact on the old configuration, and new
// connections get the new one.
func TestListenerWrapperReload(t *testing.T) { lwReload(t) }

// TestKernelListenerWrapperReload is the reload on a kTLS kernel: the
// in-flight downloads run on offloaded connections (the HTTP/1.1 one with
// sendfile).
func TestKernelListenerWrapperReload(t *testing.T) {
	kerneltest.Require(t)
	before := ktls.Stats().Outcomes[ktls.ReasonNone]
	lwReload(t)
	// The probe, the two in-flight downloads, the two connections after
	// the reload.
	if got := ktls.Stats().Outcomes[ktls.ReasonNone] - before; got != 5 {
		t.Errorf("%d fully offloaded connections, want 5", got)
	}
}

// lwTCPSendBufferMax is the most payload the kernel lets a TCP socket
// queue without an explicit SO_SNDBUF (neither Go nor Caddy sets one): the
// autotuning limit tcp_wmem[2].
func lwTCPSendBufferMax(t *testing.T) uint64 {
	t.Helper()
	b, err := os.ReadFile("/proc/sys/net/ipv4/tcp_wmem")
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(string(b))
	if len(f) != 3 {
		t.Fatalf("tcp_wmem: %q", b)
	}
	n, err := strconv.ParseUint(f[2], 10, 64)
	if err != nil {
		t.Fatalf("tcp_wmem: %q: %v", b, err)
	}
	return n
}

func lwReload(t *testing.T) {
	s := lwStartSite(t, map[string]any{"sendfile": true})
	// A body the server cannot have handed to the kernel whole while the
	// clients pause: more than the server socket's largest send buffer
	// plus what a paused client takes in (an HTTP/2 client keeps reading
	// into its stream window, up to 4 MiB).
	sndbufMax := lwTCPSendBufferMax(t)
	big := make([]byte, max(lwTestMiB(t)<<20, int(2*sndbufMax)+2<<20)+45)
	rand.Read(big)
	if err := os.WriteFile(filepath.Join(filepath.Dir(s.logFile), "www", "files", "big.bin"), big, 0o644); err != nil {
		t.Fatal(err)
	}
	url := s.url("localhost", "/files/big.bin")
	downloads := []*lwPausedDownload{s.startDownload(t, "HTTP/1.1 download", url, false), s.startDownload(t, "HTTP/2 download", url, true)}

	s.reload(t, "v2")

	// Mid-response at the reload: everything the server had written by
	// then is at most what the client has received now plus a full send
	// buffer, and that is less than the body.
	for _, d := range downloads {
		if got := d.received(t); got+sndbufMax >= uint64(len(big)) {
			t.Fatalf("%s: the client received %d bytes; with a %d-byte send buffer the server may have written all %d: not provably mid-response",
				d.name, got, sndbufMax, len(big))
		}
	}
	errs := make([]error, len(downloads))
	bodies := make([][]byte, len(downloads))
	var wg sync.WaitGroup
	for i, d := range downloads {
		wg.Go(func() { bodies[i], errs[i] = d.finish() })
	}
	wg.Wait()
	for i, d := range downloads {
		if errs[i] != nil {
			t.Errorf("%s after the reload: %v", d.name, errs[i])
		} else if lwSHA(bodies[i]) != lwSHA(big) || len(bodies[i]) != len(big) {
			t.Errorf("%s after the reload: %d bytes, SHA-256 %s; want %d bytes, %s", d.name, len(bodies[i]), lwSHA(bodies[i]), len(big), lwSHA(big))
		}
	}
	for _, fresh := range []struct {
		client *http.Client
		major  int
	}{{s.h1(nil), 1}, {s.h2(nil), 2}} {
		if got := string(lwGet(t, fresh.client, s.url("localhost", "/tls"), fresh.major)); !strings.HasPrefix(got, "v2 https ") {
			t.Errorf("new HTTP/%d connection after the reload: %q, want the v2 config", fresh.major, got)
		}
		fresh.client.CloseIdleConnections()
	}
}

// TestListenerWrapperNoLeaks checks that connections through the wrapper
// leave no file descriptors or goroutines behind once closed.
func TestListenerWrapperNoLeaks(t *testing.T) {
	s := lwStartSite(t, nil)
	round := func() {
		for _, c := range []struct {
			client *http.Client
			major  int
		}{{s.h1(nil), 1}, {s.h2(nil), 2}} {
			lwGet(t, c.client, s.url("localhost", "/tls"), c.major)
			c.client.CloseIdleConnections()
		}
	}
	round() // first use starts what lives as long as the server
	fdsBefore, gBefore := lwSettle(t)
	for range 5 {
		round()
	}
	lwWaitReleased(t, fdsBefore, gBefore)
}

// TestListenerWrapperRejectsBadPlacement: ktls must come right after `tls`.
// Before it the wrapper would see raw TCP connections; after another
// wrapper (or a second ktls) it would see that wrapper's connections, never
// Caddy's *tls.Conn, and offload none. Loading must fail and say why; a
// wrapper before `tls` is fine.
func TestListenerWrapperRejectsBadPlacement(t *testing.T) {
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	for name, tc := range map[string]struct{ wrappers, want string }{
		"before tls": {`{"wrapper":"ktls"},{"wrapper":"tls"}`, "must come after tls"},
		"after another wrapper": {`{"wrapper":"proxy_protocol"},{"wrapper":"tls"},{"wrapper":"layer4"},{"wrapper":"ktls"}`,
			`position 3 of listener_wrappers, after "layer4" at 2; it must come right after tls`},
		"after another wrapper, tls implied": {`{"wrapper":"layer4"},{"wrapper":"ktls"}`,
			`position 1 of listener_wrappers, after "layer4" at 0; it must come right after tls`},
		"twice":              {`{"wrapper":"ktls"},{"wrapper":"ktls"}`, `after "ktls" at 0; it must come right after tls`},
		"wrapper before tls": {`{"wrapper":"proxy_protocol"},{"wrapper":"tls"},{"wrapper":"ktls"}`, ""},
		"layer4 after ktls":  {`{"wrapper":"ktls"},{"wrapper":"layer4"}`, ""},
	} {
		t.Run(name, func(t *testing.T) {
			cfg := fmt.Sprintf(`{"admin":{"disabled":true},"apps":{"http":{"servers":{"s":{
				"listen":["127.0.0.1:%d"],"listener_wrappers":[%s],"routes":[]}}}}}`, loopbackPort(t), tc.wrappers)
			err := caddy.Load([]byte(cfg), true)
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case tc.want == "":
				if err := caddy.Load([]byte(unloadConfig), true); err != nil {
					t.Errorf("unload: %v", err)
				}
			case err == nil:
				caddy.Stop()
				t.Fatal("accepted")
			case !strings.Contains(err.Error(), tc.want):
				t.Fatalf("error does not explain the placement: %v (want %q)", err, tc.want)
			}
		})
	}
}

// TestListenerWrapperRejectsBadOptions checks the errors of Provision.
func TestListenerWrapperRejectsBadOptions(t *testing.T) {
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	cases := map[string]struct {
		wrapper string
		want    string
	}{
		"zerocopy without sendfile": {`{"wrapper":"ktls","tx_zerocopy_ro":true}`, "`tx_zerocopy_ro` only affects sendfile: add `sendfile`"},
		"negative rate":             {`{"wrapper":"ktls","keyupdate_rate":-1}`, "must not be negative"},
		"record limit above 2^24":   {`{"wrapper":"ktls","key_record_limit":16777217}`, "`key_record_limit` 16777217 is above 16777216"},
		"offload off but required":  {`{"wrapper":"ktls","disable_offload":true,"require_offload":true}`, "`offload off` (JSON disable_offload) and `fallback refuse` (JSON require_offload) together would refuse every connection"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			cfg := fmt.Sprintf(`{"admin":{"disabled":true},"apps":{"http":{"servers":{"s":{
				"listen":["127.0.0.1:%d"],"listener_wrappers":[%s],"routes":[]}}}}}`, loopbackPort(t), tc.wrapper)
			err := caddy.Load([]byte(cfg), true)
			if err == nil {
				caddy.Stop()
				t.Fatal("accepted")
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q does not contain %q", err, tc.want)
			}
		})
	}
}

// TestListenerWrapperHandshakeTimeout: a client that connects and sends
// nothing is closed once handshake_timeout has passed (not before it, and
// well before the 10 s default), and the wrapper counts and logs the
// failed handshake.
func TestListenerWrapperHandshakeTimeout(t *testing.T) {
	const timeout = 500 * time.Millisecond
	s := lwStartSite(t, map[string]any{"handshake_timeout": timeout.String()})
	before := ktls.Stats().Outcomes[ktls.ReasonHandshakeFailed]
	metrics0 := parseMetrics(t, adminGet(t, s.adminAddr, "/metrics"))
	// The server's timer starts when it accepts, which can be before the
	// client's connect(2) returns: count from before the dial.
	start := time.Now()
	c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", s.port))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetReadDeadline(start.Add(time.Minute))
	n, err := c.Read(make([]byte, 1))
	elapsed := time.Since(start)
	if n != 0 || err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("a silent client: read %d bytes, %v after %v; want the server to close", n, err, elapsed)
	}
	if elapsed < timeout || elapsed >= offload.DefaultHandshakeTimeout {
		t.Errorf("a silent client was closed after %v; want handshake_timeout %v (default %v)", elapsed, timeout, offload.DefaultHandshakeTimeout)
	}
	deadline := time.Now().Add(10 * time.Second)
	for ktls.Stats().Outcomes[ktls.ReasonHandshakeFailed]-before != 1 {
		if time.Now().After(deadline) {
			t.Fatalf("handshake-failed outcomes +%d, want +1", ktls.Stats().Outcomes[ktls.ReasonHandshakeFailed]-before)
		}
		time.Sleep(10 * time.Millisecond)
	}
	// The outcome is counted before the observer logs it: wait for the
	// lines, then check there is one of each.
	mine := func(msg string) []map[string]any {
		var out []map[string]any
		for _, l := range s.logLines(t, msg) {
			if l["remote"] == c.LocalAddr().String() {
				out = append(out, l)
			}
		}
		return out
	}
	waitUntil(t, 10*time.Second, func() bool {
		return len(mine("kernel TLS handshake")) > 0 && len(mine("TLS handshake failed")) > 0
	}, "the silent client's handshake log lines")
	lines := mine("kernel TLS handshake")
	if len(lines) != 1 || lines[0]["reason"] != string(ktls.ReasonHandshakeFailed) || !strings.Contains(fmt.Sprint(lines[0]["error"]), "deadline exceeded") {
		t.Errorf("handshake log lines for the silent client: %v; want one, handshake-failed, deadline exceeded", lines)
	}
	failed := mine("TLS handshake failed")
	if len(failed) != 1 || failed[0]["reason"] != "timeout" || failed[0]["level"] != "debug" {
		t.Errorf("failed-handshake log lines for the silent client: %v; want one at DEBUG, reason timeout", failed)
	}
	series := fmt.Sprintf("caddy_ktls_handshake_failures_total{module=%q,reason=\"timeout\"}", moduleid.ListenerWrapper)
	if got := parseMetrics(t, adminGet(t, s.adminAddr, "/metrics"))[series] - metrics0[series]; got != 1 {
		t.Errorf("%s rose by %v, want 1", series, got)
	}
}
