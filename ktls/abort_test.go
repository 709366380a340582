package ktls

import (
	"crypto/sha256"
	"crypto/tls"
	"errors"
	"io"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/sockerr"
)

// TestAbort: the client reads every byte the server wrote before Abort (or
// Refuse), then an error, where Close would give it a clean end. Without
// kernel TLS the error is a reset; after CloseWrite, both keep the orderly
// end.
func TestAbort(t *testing.T) { abort(t, false) }

// TestKernelAbort is TestAbort with TX in the kernel, where the error is a
// fatal alert sealed by the kernel behind the data: internal_error after
// Abort, access_denied after Refuse.
func TestKernelAbort(t *testing.T) {
	kerneltest.Require(t)
	abort(t, true)
}

func abort(t *testing.T, kernel bool) {
	p := newTestPKI(t)
	scfg, ccfg := p.configs(connCase{version: tls.VersionTLS13})
	ends := []struct {
		name  string
		end   func(*Conn) error
		alert string // as crypto/tls reports it
	}{
		{"Abort", (*Conn).Abort, "remote error: tls: internal error"},
		{"Refuse", (*Conn).Refuse, "remote error: tls: access denied"},
	}
	for _, e := range ends {
		for _, halfClosed := range []bool{false, true} {
			pr, err := dialPair(t, scfg, ccfg, Options{}, nil)
			if err != nil {
				t.Fatal(err)
			}
			if tx := pr.server.Offload().TX; (tx != ModeUserspace) != kernel {
				t.Fatalf("server TX %v; this test wants it in the kernel: %v", tx, kernel)
			}
			const n = 64 << 10
			if _, err := io.Copy(pr.server, payload(8, n)); err != nil {
				t.Fatal(err)
			}
			if halfClosed {
				if err := pr.server.CloseWrite(); err != nil {
					t.Fatal(err)
				}
			}
			if err := e.end(pr.server); err != nil {
				t.Fatalf("%s: %v", e.name, err)
			}
			pr.client.SetReadDeadline(time.Now().Add(10 * time.Second))
			h := sha256.New()
			got, readErr := io.Copy(h, pr.client)
			readErr = sockerr.ReadError(pr.client, readErr)
			want, _, _ := sum256(payload(8, n))
			if got != n || [32]byte(h.Sum(nil)) != want {
				t.Errorf("%s, half-closed %v: the client read %d bytes (intact: %v), want the %d written before it", e.name, halfClosed, got, [32]byte(h.Sum(nil)) == want, n)
			}
			switch {
			case halfClosed && readErr != nil:
				t.Errorf("after close_notify and %s the client's read ended with %v, want the orderly end", e.name, readErr)
			case !halfClosed && kernel && (readErr == nil || !strings.Contains(readErr.Error(), e.alert)):
				t.Errorf("after %s the client's read ended with %v, want %q", e.name, readErr, e.alert)
			case !halfClosed && !kernel && !errors.Is(readErr, syscall.ECONNRESET):
				t.Errorf("after %s the client's read ended with %v, want a reset", e.name, readErr)
			}
			pr.close()
		}
	}
}
