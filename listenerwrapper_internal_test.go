package caddyktls

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddytls"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/offload"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// TestListenerWrapperTLSInternal serves a Caddyfile site with `tls internal`
// through the wrapper: Caddy's own CA issues the certificate, the wrapper
// only takes over after the handshake.
func TestListenerWrapperTLSInternal(t *testing.T) {
	data := t.TempDir()
	t.Setenv("XDG_DATA_HOME", data)
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	port := loopbackPort(t)
	caddyfile := fmt.Sprintf(`{
	admin off
	persist_config off
	skip_install_trust
	storage file_system %s
	http_port %d
	https_port %d
	servers {
		listener_wrappers {
			ktls
		}
	}
}

localhost:%d {
	tls internal
	respond "{http.request.tls.version} {http.request.tls.proto} {http.request.tls.server_name}"
}
`, data, loopbackPort(t), port, port)
	cfg, err := adaptCaddyfile(t, caddyfile)
	if err != nil {
		t.Fatalf("adapt: %v", err)
	}
	if err := caddy.Load(cfg, true); err != nil {
		t.Fatalf("load: %v", err)
	}
	t.Cleanup(func() {
		if err := caddy.Load([]byte(`{"admin":{"disabled":true,"config":{"persist":false}}}`), true); err != nil {
			t.Errorf("unload: %v", err)
		}
	})
	before := ktls.Stats().Outcomes
	// The certificate is issued in the background: until then handshakes
	// fail. The root appears in the storage directory (explicit: Caddy's
	// default storage path is fixed at init, before t.Setenv).
	rootFile := filepath.Join(data, "pki", "authorities", "local", "root.crt")
	s := &lwSite{port: port}
	deadline := time.Now().Add(30 * time.Second)
	for {
		pool := x509.NewCertPool()
		pem, err := os.ReadFile(rootFile)
		if err == nil && pool.AppendCertsFromPEM(pem) {
			c := s.h2(&tls.Config{RootCAs: pool})
			resp, err := c.Get(s.url("localhost", "/"))
			if err == nil {
				resp.Body.Close()
				got := string(lwGet(t, c, s.url("localhost", "/"), 2))
				c.CloseIdleConnections()
				if got != "tls1.3 h2 localhost" {
					t.Errorf("tls internal site: %q", got)
				}
				break
			}
			c.CloseIdleConnections()
		}
		if time.Now().After(deadline) {
			t.Fatalf("tls internal site never answered (root %s: %v)", rootFile, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	after := ktls.Stats().Outcomes
	served := 0
	for _, r := range ktls.Reasons() {
		if r != ktls.ReasonHandshakeFailed {
			served += int(after[r] - before[r])
		}
	}
	if served < 1 {
		t.Errorf("no handshake went through the ktls wrapper (outcomes before %v, after %v)", before, after)
	}
}

// TestListenerWrapperStartSummary checks the line the wrapper logs as it
// wraps each listener: it names the server and the listener; with
// `offload off` it says offload is off because of the configuration (never
// "kernel TLS available ... offload on", whatever the kernel can do), and
// otherwise it reports the kernel's probe, with what to do where it cannot
// offload; it never claims RX in the kernel for connections that are not
// offloaded, and says when sendfile is off for want of kernel TX. On the
// HTTP port it says only, at DEBUG, that connections pass through.
func TestListenerWrapperStartSummary(t *testing.T) {
	kernelOK := kerneltest.Available() == nil
	probed, offloaded, rxInKernel := "kernel TLS unavailable: connections use userspace TLS", false, any(nil)
	if kernelOK {
		probed, offloaded, rxInKernel = "kernel TLS available", true, true
	}
	disabled := "kernel TLS offload disabled: connections use userspace TLS"
	for name, tc := range map[string]struct {
		opts               offload.Options
		sendfile           bool
		msg                string
		offloaded          bool
		why                string
		rxInKernel         any // absent (nil) where nothing is offloaded
		kernelTLSAvailable any // logged only when offload is off by configuration
		sendfileOn         bool
	}{
		"default":     {offload.Options{}, false, probed, offloaded, "", rxInKernel, nil, false},
		"rx off":      {offload.Options{DisableRX: true}, false, probed, offloaded, "", map[bool]any{true: false, false: nil}[kernelOK], nil, false},
		"offload off": {offload.Options{DisableOffload: true}, false, disabled, false, "disabled by configuration (offload off)", nil, kernelOK, false},
		// expect_no_pad would warn on a kernel without it; with offload off
		// there is nothing to warn about.
		"offload off, expect_no_pad": {offload.Options{DisableOffload: true, ExpectNoPad: true}, false, disabled, false, "disabled by configuration (offload off)", nil, kernelOK, false},
		"sendfile":                   {offload.Options{}, true, probed, offloaded, "", rxInKernel, nil, kernelOK},
		"offload off, sendfile":      {offload.Options{DisableOffload: true}, true, disabled, false, "disabled by configuration (offload off)", nil, kernelOK, false},
	} {
		t.Run(name, func(t *testing.T) {
			core, logs := observer.New(zapcore.DebugLevel)
			lw := &ListenerWrapper{Options: tc.opts, ctx: caddy.Context{Context: context.Background()},
				srv: &caddyhttp.Server{TLSConnPolicies: caddytls.ConnectionPolicies{new(caddytls.ConnectionPolicy)}}, logger: zap.New(core)}
			lw.sendfile = tc.sendfile
			if lw.sendfile && !lw.Options.KernelCanOffload() {
				lw.sendfile, lw.sendfileIdle = false, true // as Provision decides
			}
			addr := &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 8443}
			lw.logStart(addr, lw.servesTLS(addr))
			entries := logs.All()
			if len(entries) != 1 {
				t.Fatalf("%d log lines, want exactly the summary: %v", len(entries), entries)
			}
			e := entries[0]
			fields := e.ContextMap()
			if e.Level != zapcore.InfoLevel || e.Message != tc.msg {
				t.Errorf("summary %s %q, want INFO %q", e.Level, e.Message, tc.msg)
			}
			if fields["listener"] != "127.0.0.1:8443" || fields["server"] == nil {
				t.Errorf("summary fields %v: want the server and listener 127.0.0.1:8443", fields)
			}
			if _, named := fields["offload"]; named || fields["offloaded"] != tc.offloaded || fields["rx_in_kernel"] != tc.rxInKernel {
				t.Errorf("summary fields %v: want offloaded %v (never an offload field, which reads as the option), rx_in_kernel %v", fields, tc.offloaded, tc.rxInKernel)
			}
			if tc.why != "" && fields["why"] != tc.why {
				t.Errorf("summary why %q, want %q", fields["why"], tc.why)
			}
			if !tc.offloaded && tc.why == "" && fields["fix"] == nil {
				t.Errorf("summary fields %v: no fix where the kernel cannot offload", fields)
			}
			if fields["kernel_tls_available"] != tc.kernelTLSAvailable {
				t.Errorf("summary kernel_tls_available %v, want %v", fields["kernel_tls_available"], tc.kernelTLSAvailable)
			}
			if fields["sendfile"] != tc.sendfileOn || (tc.sendfile && !tc.sendfileOn) != (fields["sendfile_off"] != nil) {
				t.Errorf("summary fields %v: want sendfile %v, and sendfile_off exactly where sendfile is set but off", fields, tc.sendfileOn)
			}
		})
	}
	t.Run("http port", func(t *testing.T) {
		core, logs := observer.New(zapcore.DebugLevel)
		lw := &ListenerWrapper{ctx: caddy.Context{Context: context.Background()},
			srv: &caddyhttp.Server{TLSConnPolicies: caddytls.ConnectionPolicies{new(caddytls.ConnectionPolicy)}}, logger: zap.New(core)}
		addr := &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: caddyhttp.DefaultHTTPPort}
		lw.logStart(addr, lw.servesTLS(addr))
		if e := logs.All(); len(e) != 1 || e[0].Level != zapcore.DebugLevel {
			t.Errorf("HTTP port: log lines %v, want one DEBUG line (its connections pass through)", e)
		}
	})
}
