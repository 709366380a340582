package ktls

import (
	"crypto/tls"
	"errors"
	"io"
	"net"
	"os"
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

// userspacePipe is a client Conn in userspace TLS 1.3 and its crypto/tls
// server over a net.Pipe, handshakes done: a write waits until the peer
// reads it.
func userspacePipe(t *testing.T) (*Conn, *tls.Conn) {
	t.Helper()
	scfg, ccfg := newTestPKI(t).configs(connCase{version: tls.VersionTLS13})
	a, b := net.Pipe()
	client, server := userspacePair(t, a, b, scfg, ccfg, true)
	t.Cleanup(func() { client.Close(); server.Close() })
	// Before them, the pipe: it ends whatever a failed test left waiting.
	t.Cleanup(func() { a.Close(); b.Close() })
	return client, server
}

// On the userspace path a half-close waits for a peer that reads slowly
// as long as a Write would (the caller's deadline): crypto/tls's own fixed
// 5 s deadline on its close_notify would fail it and lose the end of the
// stream for good.
func TestCloseWriteUserspaceWaitsForTheReader(t *testing.T) {
	t.Parallel()
	client, server := userspacePipe(t)
	done := make(chan error, 1)
	go func() { done <- client.CloseWrite() }()
	time.Sleep(6 * time.Second) // past crypto/tls's 5 s
	server.SetReadDeadline(time.Now().Add(10 * time.Second))
	// Nothing but close_notify ends a pipe whose writer is open.
	if n, err := server.Read(make([]byte, 1)); n != 0 || err != io.EOF {
		t.Fatalf("the server read %d bytes, %v; want the end by close_notify", n, err)
	}
	if err := <-done; err != nil {
		t.Fatalf("CloseWrite: %v", err)
	}
}

// The caller's write deadline bounds the wait, and a Close meanwhile ends
// it at once: no Close waits behind a peer that does not read.
func TestCloseWriteUserspaceBounded(t *testing.T) {
	t.Run("deadline", func(t *testing.T) {
		client, _ := userspacePipe(t)
		client.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
		if err := client.CloseWrite(); !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("CloseWrite past the deadline: %v, want %v", err, os.ErrDeadlineExceeded)
		}
	})
	t.Run("close", func(t *testing.T) {
		client, _ := userspacePipe(t)
		done := make(chan error, 1)
		go func() { done <- client.CloseWrite() }()
		for !client.record.closeWriting.Load() {
			time.Sleep(time.Millisecond)
		}
		closed := make(chan error, 1)
		go func() { closed <- client.Close() }()
		bound := time.After(time.Minute)
		for _, c := range []chan error{done, closed} {
			select {
			case err := <-c:
				if c == done && err == nil {
					t.Fatal("CloseWrite succeeded with nobody reading")
				}
			case <-bound:
				t.Fatal("CloseWrite or Close still waits a minute after Close")
			}
		}
	})
}
