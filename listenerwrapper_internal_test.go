package caddyktls

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
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

// TestListenerWrapperStartSummary checks the info line the wrapper logs at
// start: with `offload off` it says offload is off because of the
// configuration (never "kernel TLS available ... offload on", whatever the
// kernel can do), and otherwise it reports the kernel's probe.
func TestListenerWrapperStartSummary(t *testing.T) {
	kernelOK := kerneltest.Available() == nil
	probed, offload := "kernel TLS unavailable: connections use userspace TLS", "off"
	if kernelOK {
		probed, offload = "kernel TLS available", "on"
	}
	for name, tc := range map[string]struct {
		opts               OffloadOptions
		msg, offload, why  string
		rxInKernel         bool
		kernelTLSAvailable any // logged only when offload is off by configuration
	}{
		"default":     {OffloadOptions{}, probed, offload, "", true, nil},
		"offload off": {OffloadOptions{DisableOffload: true}, "kernel TLS offload disabled: connections use userspace TLS", "off", "disabled by configuration (offload off)", false, kernelOK},
		// expect_no_pad would warn on a kernel without it; with offload off
		// there is nothing to warn about.
		"offload off, expect_no_pad": {OffloadOptions{DisableOffload: true, ExpectNoPad: true}, "kernel TLS offload disabled: connections use userspace TLS", "off", "disabled by configuration (offload off)", false, kernelOK},
	} {
		t.Run(name, func(t *testing.T) {
			core, logs := observer.New(zapcore.DebugLevel)
			lw := &ListenerWrapper{OffloadOptions: tc.opts, ctx: caddy.Context{Context: context.Background()},
				srv: new(caddyhttp.Server), logger: zap.New(core)}
			lw.start()
			if lw.base == nil {
				t.Error("no base TLS configuration")
			}
			entries := logs.All()
			if len(entries) != 1 {
				t.Fatalf("%d log lines, want exactly the summary: %v", len(entries), entries)
			}
			e := entries[0]
			fields := e.ContextMap()
			if e.Level != zapcore.InfoLevel || e.Message != tc.msg {
				t.Errorf("summary %s %q, want INFO %q", e.Level, e.Message, tc.msg)
			}
			if fields["offload"] != tc.offload || fields["rx_in_kernel"] != tc.rxInKernel {
				t.Errorf("summary fields %v: want offload %q, rx_in_kernel %v", fields, tc.offload, tc.rxInKernel)
			}
			if tc.why != "" && fields["why"] != tc.why {
				t.Errorf("summary why %q, want %q", fields["why"], tc.why)
			}
			if fields["kernel_tls_available"] != tc.kernelTLSAvailable {
				t.Errorf("summary kernel_tls_available %v, want %v", fields["kernel_tls_available"], tc.kernelTLSAvailable)
			}
		})
	}
}
