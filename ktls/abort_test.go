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
)

// TestAbort: the client reads every byte the server wrote before Abort,
// then an error, where Close would give it a clean end. Without kernel TLS
// the error is a reset; after CloseWrite, Abort keeps the orderly end.
func TestAbort(t *testing.T) { abort(t, false) }

// TestKernelAbort is TestAbort with TX in the kernel, where the error is
// the fatal internal_error alert, sealed by the kernel behind the data.
func TestKernelAbort(t *testing.T) {
	kerneltest.Require(t)
	abort(t, true)
}

func abort(t *testing.T, kernel bool) {
	p := newTestPKI(t)
	scfg, ccfg := p.configs(connCase{version: tls.VersionTLS13})
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
		if err := pr.server.Abort(); err != nil {
			t.Fatalf("Abort: %v", err)
		}
		pr.client.SetReadDeadline(time.Now().Add(10 * time.Second))
		h := sha256.New()
		got, readErr := io.Copy(h, pr.client)
		want, _, _ := sum256(payload(8, n))
		if got != n || [32]byte(h.Sum(nil)) != want {
			t.Errorf("half-closed %v: the client read %d bytes (intact: %v), want the %d written before Abort", halfClosed, got, [32]byte(h.Sum(nil)) == want, n)
		}
		switch {
		case halfClosed && readErr != nil:
			t.Errorf("after close_notify and Abort the client's read ended with %v, want the orderly end", readErr)
		case !halfClosed && kernel && (readErr == nil || !strings.Contains(readErr.Error(), "remote error: tls: internal error")):
			t.Errorf("after Abort the client's read ended with %v, want the internal_error alert", readErr)
		case !halfClosed && !kernel && !errors.Is(readErr, syscall.ECONNRESET):
			t.Errorf("after Abort the client's read ended with %v, want a reset", readErr)
		}
		pr.close()
	}
}
