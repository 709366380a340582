package caddyktls

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/gateway"
	"github.com/ktlsingress/caddy-ktls/internal/cputest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/listensock"
	"github.com/ktlsingress/caddy-ktls/internal/offload"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/modules/forwarder"
)

// While max_handshakes handshakes are in progress, the ktls handler sheds
// a new connection before any handshake work: the client reads exactly a
// plaintext access_denied alert and the end, a gateway's dial fails as
// overloaded (safe to retry), and each shed is counted and summarized.
// The handshakes admitted before are untouched: once one of them ends, a
// tunnel is admitted again and carries every byte. On a plain `tcp/`
// address the handler sheds; a `tcp-retry/` or `tcp-handoff/` listener
// sheds in its name before caddy-l4 takes the connection, and says so in
// each shed's DEBUG line.
func TestSandboxShedsHandshakes(t *testing.T) { sandboxShedsHandshakes(t, false) }

// TestKernelSandboxShedsHandshakes is TestSandboxShedsHandshakes on a
// kTLS kernel: the shed connections install no key (tls_stat does not
// move), and the tunnel admitted after them runs in the kernel, spliced.
func TestKernelSandboxShedsHandshakes(t *testing.T) {
	kerneltest.Require(t)
	sandboxShedsHandshakes(t, true)
}

func sandboxShedsHandshakes(t *testing.T, kernel bool) {
	for _, network := range []string{"tcp", listensock.RetryNetwork, listensock.Network} {
		t.Run(network, func(t *testing.T) { sandboxShedsHandshakesOn(t, kernel, network) })
	}
}

func sandboxShedsHandshakesOn(t *testing.T, kernel bool, network string) {
	const size = 256 << 10
	up := forwardtest.NewUpstream(t, size+3) // a reply unlike the request's size (exactTunnel)
	e := newSandboxConfig(t, nil)
	e.route()["handle"].([]any)[0].(map[string]any)["max_handshakes"] = 2
	e.cfg["apps"].(map[string]any)["layer4"].(map[string]any)["servers"].(map[string]any)["tunnels"].(map[string]any)["listen"] = []string{network + "/" + e.addr}
	e.cfg["logging"].(map[string]any)["logs"].(map[string]any)["default"].(map[string]any)["level"] = "DEBUG"
	e.start(t)
	inProgress := `caddy_ktls_handshakes_in_progress`
	shedSeries := `caddy_ktls_handshake_failures_total{module="layer4.handlers.ktls",reason="overloaded"}`
	waitInProgress := func(n int64) {
		t.Helper()
		waitUntil(t, 30*time.Second, func() bool { return e.metric(t, inProgress) == n }, "the handshakes in progress to settle")
	}

	// Two connections that never send a ClientHello hold both handshakes
	// (until handshake_timeout).
	held := holdHandshakes(t, e.addr, 2)
	waitInProgress(2)
	shed0 := e.metric(t, shedSeries)
	since := dataPathDelta(t, kernel)

	// A gateway's dial: overloaded, before any handshake.
	d, err := gateway.New(gateway.Config{TLS: e.tlsConfig(e.client), Signer: e.gw.Signer})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	route := gateway.Route{Forwarder: e.addr, Sandbox: "sbx-shed", Target: up.Addr()}
	_, err = d.Dial(ctx, route)
	var de *gateway.DialError
	if !errors.Is(err, gateway.ErrOverloaded) || !errors.As(err, &de) || de.Step != gateway.StepHandshake || !gateway.RetrySafe(err) {
		t.Fatalf("gateway dial while 2 handshakes are in progress: %v, want a retry-safe DialError at the handshake with ErrOverloaded", err)
	}
	// On the wire: the alert record, then the end, whatever the client sent.
	checkShedAlert(t, e.addr, "a shed connection")
	if n := e.metric(t, shedSeries) - shed0; n != 2 {
		t.Errorf("%s moved by %d, want 2 (the gateway's and the raw connection)", shedSeries, n)
	}
	byListener := 0
	for _, l := range e.logLines(t, "TLS handshake refused: overloaded") {
		if l["shed_by"] == "listener" {
			byListener++
		}
	}
	if want := map[bool]int{true: 2, false: 0}[network != "tcp"]; byListener != want {
		t.Errorf("%d of the sheds' DEBUG lines say a %s listener shed them, want %d", byListener, network, want)
	}
	if n := e.metric(t, inProgress); n != 2 {
		t.Errorf("%d handshakes in progress after the sheds, want the 2 held", n)
	}
	summary := e.waitLogLine(t, offload.HandshakeFailureSummary, 0)
	if n, _ := summary[offload.ReasonOverloaded].(float64); n < 1 {
		t.Errorf("the handshake failure summary %v counts no %s", summary, offload.ReasonOverloaded)
	}
	if stat, dp := since(); stat["TlsTxSw"] != 0 || stat["TlsRxSw"] != 0 || dp.SpliceBytes+dp.CopyBytes != 0 {
		t.Errorf("the sheds installed keys or moved bytes: tls_stat delta %v, data path %+v", stat, dp)
	}
	if up.Accepted() != 0 {
		t.Errorf("the upstream was dialed %d times while every connection was shed", up.Accepted())
	}

	// One held handshake ends (its client closes): one is admitted again.
	held[0].Close()
	waitInProgress(1)
	since = dataPathDelta(t, kernel)
	e.exactTunnel(t, "sbx-after-shed", up, size, 7)
	stat, dp := since()
	if kernel && (stat["TlsTxSw"] < 1 || stat["TlsRxSw"] < 1 || dp.CopyBytes != 0 || dp.SpliceBytes != 2*size+3) {
		t.Errorf("the admitted tunnel: tls_stat delta %v, data path %+v; want keys installed and %d bytes spliced", stat, dp, 2*size+3)
	}
	if !kernel && dp.SpliceBytes+dp.CopyBytes != 2*size+3 {
		t.Errorf("the admitted tunnel moved %+v, want %d bytes", dp, 2*size+3)
	}
}

// max_handshakes bounds the process's handshakes, not one handler's: while
// the handshakes of one server's ktls handler fill it, another server's
// handler sheds (its own bound is the same), and once they end it admits
// a tunnel again, which carries every byte.
func TestSandboxMaxHandshakesSharedByHandlers(t *testing.T) {
	const size = 64 << 10
	up := forwardtest.NewUpstream(t, size+3)
	e := newSandboxConfig(t, nil)
	e.route()["handle"].([]any)[0].(map[string]any)["max_handshakes"] = 2
	servers := e.cfg["apps"].(map[string]any)["layer4"].(map[string]any)["servers"].(map[string]any)
	other, err := json.Marshal(servers["tunnels"])
	if err != nil {
		t.Fatal(err)
	}
	var second map[string]any
	if err := json.Unmarshal(other, &second); err != nil {
		t.Fatal(err)
	}
	secondAddr := loopbackAddr(t)
	second["listen"] = []string{secondAddr}
	servers["tunnels-2"] = second
	e.start(t)
	inProgress := `caddy_ktls_handshakes_in_progress`
	shedSeries := `caddy_ktls_handshake_failures_total{module="layer4.handlers.ktls",reason="overloaded"}`

	// Two connections to the first server that never send a ClientHello.
	held := holdHandshakes(t, e.addr, 2)
	waitUntil(t, 30*time.Second, func() bool { return e.metric(t, inProgress) == 2 }, "the 2 held handshakes")
	shed0 := e.metric(t, shedSeries)
	checkShedAlert(t, secondAddr, "the second server's connection")
	if n := e.metric(t, shedSeries) - shed0; n != 1 {
		t.Errorf("%s moved by %d, want 1", shedSeries, n)
	}

	for _, c := range held {
		c.Close()
	}
	waitUntil(t, 30*time.Second, func() bool { return e.metric(t, inProgress) == 0 }, "the held handshakes to end")
	d, err := gateway.New(gateway.Config{TLS: e.tlsConfig(e.client), Signer: e.gw.Signer})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := d.Dial(ctx, gateway.Route{Forwarder: secondAddr, Sandbox: "sbx-shared-bound", Target: up.Addr()})
	if err != nil {
		t.Fatalf("the second server once no handshake is in progress: %v", err)
	}
	n, sum, err := transfer(c, size, 9)
	if err != nil {
		t.Fatalf("the tunnel through the second server: %v", err)
	}
	checkTunnelTransfer(t, up, size, 9, n, sum)
}

// A listener sheds in the name of the handlers of the configurations
// loaded now: after a reload raises max_handshakes, a connection that the
// old bound would shed is admitted at once, before any connection reached
// the new handler, and its tunnel carries every byte.
func TestSandboxShedAtAcceptFollowsReload(t *testing.T) {
	const size = 64 << 10
	up := forwardtest.NewUpstream(t, size+3)
	e := newSandboxConfig(t, nil)
	ktlsHandler := e.route()["handle"].([]any)[0].(map[string]any)
	ktlsHandler["max_handshakes"] = 2
	e.cfg["apps"].(map[string]any)["layer4"].(map[string]any)["servers"].(map[string]any)["tunnels"].(map[string]any)["listen"] = []string{listensock.Network + "/" + e.addr}
	e.start(t)
	inProgress := `caddy_ktls_handshakes_in_progress`
	holdHandshakes(t, e.addr, 2)
	waitUntil(t, 30*time.Second, func() bool { return e.metric(t, inProgress) == 2 }, "the 2 held handshakes")
	checkShedAlert(t, e.addr, "a connection past max_handshakes 2")

	ktlsHandler["max_handshakes"] = 3
	e.load(t)
	if n := e.metric(t, inProgress); n != 2 {
		t.Fatalf("%d handshakes in progress after the reload, want the 2 held", n)
	}
	e.exactTunnel(t, "sbx-after-reload", up, size, 5)
}

// holdHandshakes opens n connections to addr that never send a
// ClientHello: each holds a handshake in progress until handshake_timeout
// or its close (at the test's end, if not before).
func holdHandshakes(t testing.TB, addr string, n int) []net.Conn {
	t.Helper()
	held := make([]net.Conn, 0, n)
	t.Cleanup(func() {
		for _, c := range held {
			c.Close()
		}
	})
	for range n {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
	}
	return held
}

// checkShedAlert fails t unless a new connection to addr reads exactly the
// plaintext access_denied alert record, then the end (ktls.Shed).
func checkShedAlert(t *testing.T, addr, what string) {
	t.Helper()
	raw, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	raw.SetReadDeadline(time.Now().Add(10 * time.Second))
	got, err := io.ReadAll(raw)
	raw.Close()
	if want := []byte{21, 3, 3, 0, 2, 2, 49}; !bytes.Equal(got, want) || err != nil {
		t.Errorf("%s read % x (%v), want the access_denied alert record % x and the end", what, got, err, want)
	}
}

// While max_dials tunnels are dialing (here one waiting for its sandbox to
// wake), the sandbox handler refuses a new tunnel as overloaded before it
// dials: the gateway reads the access_denied alert, the refusal is counted
// and summarized in one WARN, not one a tunnel. The admitted tunnel runs to
// its end with every byte.
func TestSandboxMaxDials(t *testing.T) { sandboxMaxDials(t, false) }

// TestKernelSandboxMaxDials is TestSandboxMaxDials on a kTLS kernel, where
// the refusal's alert is sealed by the kernel.
func TestKernelSandboxMaxDials(t *testing.T) {
	kerneltest.Require(t)
	sandboxMaxDials(t, true)
}

func sandboxMaxDials(t *testing.T, kernel bool) {
	asleep := forwardtest.ClosedPort(t)
	woken := make(chan struct{}, 4)
	plane := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		woken <- struct{}{}
		w.WriteHeader(http.StatusAccepted)
	}))
	t.Cleanup(plane.Close)
	e := newSandboxEnv(t, map[string]any{"max_dials": 1, "wake": map[string]any{"url": plane.URL + "/wake", "timeout": "30s"}})
	const size = 256 << 10
	m0 := e.metrics(t)
	done := e.goTransfer(t, "sbx-waking", asleep, size, 5)
	<-woken
	if n := e.metric(t, "caddy_ktls_sandbox_dials_in_progress"); n != 1 {
		t.Fatalf("%d dials in progress, want the waking tunnel's 1", n)
	}

	awake := forwardtest.NewUpstream(t, size+3)
	refused := e.dial(t, "sbx-awake", awake.Addr())
	_, err := io.Copy(io.Discard, refused)
	refused.Close()
	checkGatewayEnd(t, err, kernel, true)
	waitRejections(t, "overloaded", 1)
	if awake.Accepted() != 0 {
		t.Errorf("the refused tunnel's target was dialed %d times, want 0", awake.Accepted())
	}
	summary := e.waitLogLine(t, forwarder.OverloadedRefusalSummary, 0)
	if n, _ := summary["overloaded"].(float64); n != 1 {
		t.Errorf("the overload summary %v, want 1 overloaded", summary)
	}
	if lines := e.logLines(t, rejectedMsg); len(lines) != 0 {
		t.Errorf("%d WARN lines %q for an overloaded refusal, want only the summary: %v", len(lines), rejectedMsg, lines)
	}

	// The sandbox wakes: the admitted tunnel carries every byte.
	up := forwardtest.NewUpstreamOn(t, asleep.String(), size+3)
	r := <-done
	if r.err != nil {
		t.Fatalf("the admitted tunnel: %v", r.err)
	}
	checkTunnelTransfer(t, up, size, 5, r.n, r.sum)
	m1 := e.metrics(t)
	if d := m1[`caddy_ktls_sandbox_rejects_total{reason="overloaded"}`] - m0[`caddy_ktls_sandbox_rejects_total{reason="overloaded"}`]; d != 1 {
		t.Errorf("caddy_ktls_sandbox_rejects_total{reason=\"overloaded\"} moved by %d, want 1", d)
	}
	if n := m1["caddy_ktls_sandbox_dials_in_progress"]; n != 0 {
		t.Errorf("%d dials in progress after every tunnel ended, want 0", n)
	}
}

// While the process's goroutines wait longer than max_scheduling_delay for
// a CPU (here: busy goroutines, sixteen a P) and more handshakes than CPUs are
// in progress, the ktls handler sheds a new connection as it does past
// max_handshakes: the alert, a retry-safe overloaded dial, the count. With
// one handshake per CPU or fewer in progress a tunnel is admitted under the
// same delay and carries every byte; once the delay falls, tunnels are
// admitted past that floor again.
func TestSandboxShedsOnSchedulingDelay(t *testing.T) {
	const size = 64 << 10
	up := forwardtest.NewUpstream(t, 0) // no connection reaches it
	e := newSandboxConfig(t, nil)
	e.route()["handle"].([]any)[0].(map[string]any)["max_scheduling_delay"] = "5ms"
	e.cfg["logging"].(map[string]any)["logs"].(map[string]any)["default"].(map[string]any)["level"] = "DEBUG"
	e.start(t)
	cpus := runtime.GOMAXPROCS(0)
	inProgress := `caddy_ktls_handshakes_in_progress`
	shedSeries := `caddy_ktls_handshake_failures_total{module="layer4.handlers.ktls",reason="overloaded"}`
	delay := func() time.Duration {
		return time.Duration(parseMetrics(t, e.adminBody(t, "/metrics"))["caddy_ktls_scheduling_delay_seconds"] * float64(time.Second))
	}
	d, err := gateway.New(gateway.Config{TLS: e.tlsConfig(e.client), Signer: e.gw.Signer})
	if err != nil {
		t.Fatal(err)
	}
	dial := func(sandbox string, up *forwardtest.Upstream) (*ktls.Conn, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		return d.Dial(ctx, gateway.Route{Forwarder: e.addr, Sandbox: sandbox, Target: up.Addr()})
	}
	carry := func(sandbox string, seed uint64) {
		t.Helper()
		up := forwardtest.NewUpstream(t, size+3) // a reply unlike the request's size
		c, err := dial(sandbox, up)
		if err != nil {
			t.Fatalf("%s: dial: %v", sandbox, err)
		}
		n, sum, err := transfer(c, size, seed)
		if err != nil {
			t.Fatalf("%s: transfer: %v", sandbox, err)
		}
		checkTunnelTransfer(t, up, size, seed, n, sum)
	}

	// One handshake per CPU held: a new connection is past the floor.
	held := holdHandshakes(t, e.addr, cpus)
	waitUntil(t, 30*time.Second, func() bool { return e.metric(t, inProgress) == int64(cpus) }, "the held handshakes")
	stopBusy := cputest.Busy(16 * cpus)
	defer stopBusy()
	waitUntil(t, 60*time.Second, func() bool { return delay() > 5*time.Millisecond }, "a scheduling delay above 5ms")

	shed0 := e.metric(t, shedSeries)
	_, err = dial("sbx-delay-shed", up)
	var de *gateway.DialError
	if !errors.Is(err, gateway.ErrOverloaded) || !errors.As(err, &de) || de.Step != gateway.StepHandshake || !gateway.RetrySafe(err) {
		t.Fatalf("gateway dial with %d handshakes in progress and a scheduling delay of %v: %v, want a retry-safe DialError at the handshake with ErrOverloaded", cpus, delay(), err)
	}
	checkShedAlert(t, e.addr, "a connection shed for the scheduling delay")
	logged := e.waitLogLine(t, "TLS handshake refused: overloaded", 0)
	if d, _ := logged["scheduling_delay"].(float64); d <= 0.005 || logged["max_scheduling_delay"] != 0.005 ||
		logged["handshakes"] != float64(cpus+1) || logged["reason"] != offload.ReasonOverloaded {
		t.Errorf("the shed's log line %v, want its scheduling_delay above max_scheduling_delay 0.005 and %d handshakes", logged, cpus+1)
	}
	if n := e.metric(t, shedSeries) - shed0; n != 2 {
		t.Errorf("%s moved by %d, want 2 (the gateway's and the raw connection)", shedSeries, n)
	}
	if up.Accepted() != 0 {
		t.Errorf("the upstream was dialed %d times while every connection was shed", up.Accepted())
	}

	// One held handshake ends: the next is at the floor, admitted under the
	// delay.
	held[0].Close()
	waitUntil(t, 30*time.Second, func() bool { return e.metric(t, inProgress) == int64(cpus-1) }, "a held handshake to end")
	shed0 = e.metric(t, shedSeries)
	carry("sbx-delay-floor", 5)
	if n := e.metric(t, shedSeries) - shed0; n != 0 {
		t.Errorf("%d connections shed with %d handshakes in progress, want none", n, cpus-1)
	}
	if m := delay(); m <= 5*time.Millisecond {
		t.Errorf("the scheduling delay fell to %v during the tunnel at the floor: it proved nothing", m)
	}

	// The delay falls: past the floor is admitted again.
	stopBusy()
	held = append(held, holdHandshakes(t, e.addr, 1)...)
	waitUntil(t, 30*time.Second, func() bool { return e.metric(t, inProgress) == int64(cpus) }, "the held handshakes")
	waitUntil(t, 30*time.Second, func() bool { return delay() <= 5*time.Millisecond }, "the scheduling delay to fall")
	shed0 = e.metric(t, shedSeries)
	carry("sbx-delay-after", 6)
	if n := e.metric(t, shedSeries) - shed0; n != 0 {
		t.Errorf("%d connections shed once the delay fell, want none", n)
	}
}
