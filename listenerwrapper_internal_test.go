package caddyktls

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/ktlsingress/caddy-ktls/ktls"
)

// TestListenerWrapperTLSInternal serves a Caddyfile site with `tls internal`
// through the wrapper: Caddy's own CA issues the certificate, the wrapper
// only takes over after the handshake.
func TestListenerWrapperTLSInternal(t *testing.T) {
	data := t.TempDir()
	t.Setenv("XDG_DATA_HOME", data)
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	port := lwFreePort(t)
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
`, data, lwFreePort(t), port, port)
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
	for _, r := range ktls.Reasons {
		if r != ktls.ReasonHandshakeFailed {
			served += int(after[r] - before[r])
		}
	}
	if served < 1 {
		t.Errorf("no handshake went through the ktls wrapper (outcomes before %v, after %v)", before, after)
	}
}
