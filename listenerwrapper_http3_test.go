package caddyktls

import (
	"crypto/tls"
	"net/http"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// TestListenerWrapperHTTP3 serves HTTP/1.1, HTTP/2 and HTTP/3 from one
// server with the ktls wrapper, on userspace TLS here. HTTP/3 runs over
// QUIC, which Caddy does not pass through listener wrappers: it must work
// unchanged and never reach the wrapper, while h1 and h2 still do.
func TestListenerWrapperHTTP3(t *testing.T) {
	if kerneltest.Available() == nil {
		t.Skip("kTLS is available here: TestKernelListenerWrapperHTTP3 covers this kernel")
	}
	lwHTTP3(t, false)
}

// TestKernelListenerWrapperHTTP3 is the same on a kTLS kernel: h1 and h2
// are offloaded, HTTP/3 stays in quic-go.
func TestKernelListenerWrapperHTTP3(t *testing.T) {
	kerneltest.Require(t)
	lwHTTP3(t, true)
}

func lwHTTP3(t *testing.T, kernel bool) {
	s := lwStartSite(t, nil, "h1", "h2", "h3")
	// Caddy's log file writer outlives the site (see lwStartSite), so the
	// baseline is the running server, and the connections below must give
	// back everything they took while it still runs.
	fds, goroutines := lwSettle(t)
	defer lwWaitReleased(t, fds, goroutines)
	// The outcome every TCP connection through the wrapper reports here.
	wrapped := ktls.ReasonNoKernelSupport
	if kernel {
		wrapped = ktls.ReasonNone
	}
	handshakes := func() (total uint64) {
		for _, n := range ktls.Stats().Outcomes {
			total += n
		}
		return total
	}

	t.Run("h3", func(t *testing.T) {
		tr := s.h3Transport()
		defer tr.Close()
		c := &http.Client{Transport: tr, Timeout: 2 * time.Minute}
		before := handshakes()
		if got := lwGet(t, c, s.url("localhost", "/files/blob.bin"), 3); lwSHA(got) != lwSHA(s.file) || len(got) != len(s.file) {
			t.Fatalf("download: %d bytes sha %s, want %d bytes sha %s", len(got), lwSHA(got), len(s.file), lwSHA(s.file))
		}
		got := string(lwGet(t, c, s.url("localhost", "/tls"), 3))
		if want := "v1 https tls1.3 TLS_AES_128_GCM_SHA256 h3 false localhost cn="; got != want {
			t.Errorf("TLS placeholders over HTTP/3: %q, want %q", got, want)
		}
		if n := handshakes() - before; n != 0 {
			t.Errorf("HTTP/3 requests reached the ktls wrapper: %d handshake outcomes", n)
		}
	})

	for _, proto := range []struct {
		name   string
		major  int
		client func(*tls.Config) *http.Client
	}{{"h1", 1, s.h1}, {"h2", 2, s.h2}} {
		t.Run(proto.name+"-still-wrapped", func(t *testing.T) {
			c := proto.client(nil)
			defer c.CloseIdleConnections()
			before := ktls.Stats().Outcomes[wrapped]
			var got string
			get := func() { got = string(lwGet(t, c, s.url("localhost", "/tls"), proto.major)) }
			if kernel {
				d := kerneltest.StatDelta(t, get)
				if d["TlsTxSw"] < 1 || d["TlsRxSw"] < 1 {
					t.Errorf("tls_stat delta %v: want TlsTxSw and TlsRxSw >= 1", d)
				}
			} else {
				get()
			}
			if want := "v1 https tls1.3 TLS_AES_128_GCM_SHA256 " + map[int]string{1: "http/1.1", 2: "h2"}[proto.major] +
				" false localhost cn="; got != want {
				t.Errorf("TLS placeholders: %q, want %q", got, want)
			}
			if n := ktls.Stats().Outcomes[wrapped] - before; n != 1 {
				t.Errorf("%d %q outcomes for one connection, want 1 (outcomes %v)", n, wrapped, ktls.Stats().Outcomes)
			}
		})
	}
}
