package ktls

import (
	"crypto/tls"
	"io"
	"net"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
)

// closeNotified runs both ends of a stream into a Server: the client's
// close_notify (tls.Conn.CloseWrite) and its FIN alone, at a record
// boundary. Read returns all the bytes and io.EOF for both, as crypto/tls
// does; CloseNotified tells them apart.
func closeNotified(t *testing.T, opts Options, wantRXKernel bool) {
	p := newTestPKI(t)
	scfg, ccfg := p.configs(connCase{version: tls.VersionTLS13})
	for _, c := range []struct {
		name   string
		end    func(pr *pair) error
		notify bool
	}{
		{"close_notify", func(pr *pair) error { return pr.client.CloseWrite() }, true},
		{"FIN alone", func(pr *pair) error { return pr.held.Conn.(*net.TCPConn).CloseWrite() }, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			pr, err := dialPair(t, scfg, ccfg, opts, nil)
			if err != nil {
				t.Fatal(err)
			}
			if off := pr.server.Offload(); (off.RX != ModeUserspace) != wantRXKernel {
				t.Fatalf("server offload %+v, want RX in the kernel: %v", off, wantRXKernel)
			}
			if _, err := pr.client.Write([]byte("last words")); err != nil {
				t.Fatal(err)
			}
			if err := c.end(pr); err != nil {
				t.Fatal(err)
			}
			pr.server.SetReadDeadline(time.Now().Add(30 * time.Second))
			got, err := io.ReadAll(pr.server)
			if err != nil || string(got) != "last words" {
				t.Fatalf("server read %q, %v: want the bytes, then io.EOF", got, err)
			}
			if pr.server.CloseNotified() != c.notify {
				t.Errorf("CloseNotified() = %v, want %v", pr.server.CloseNotified(), c.notify)
			}
		})
	}
}

// TestCloseNotified runs where the kernel has no kTLS: crypto/tls reads.
func TestCloseNotified(t *testing.T) {
	if kerneltest.Available() == nil {
		t.Skip("the kernel has kTLS: TestKernelCloseNotified covers the kernel paths")
	}
	closeNotified(t, Options{}, false)
}

// TestKernelCloseNotified: the kernel's RX (close_notify arrives as a
// control record, the FIN as a plain end) and the userspace record opener
// (DisableRX).
func TestKernelCloseNotified(t *testing.T) {
	kerneltest.Require(t)
	t.Run("kernel RX", func(t *testing.T) { closeNotified(t, Options{}, true) })
	t.Run("DisableRX", func(t *testing.T) { closeNotified(t, Options{DisableRX: true}, false) })
}
