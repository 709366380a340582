package ktls

import (
	"crypto/sha256"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
)

// lingerCase has the server queue a response the client has not read yet,
// close with closeConn, and the client then send a few bytes (as an HTTP/2
// client sends flow-control updates while it drains) before it reads the
// rest. It returns what the client read and how its read ended, then
// closes the client and waits for closeConn to return.
func lingerCase(t *testing.T, closeConn func(*Conn) error) (got int64, sumOK bool, readErr error) {
	t.Helper()
	p := newTestPKI(t)
	scfg, ccfg := p.configs(connCase{version: tls.VersionTLS13, tickets: true})
	pr, err := dialPair(t, scfg, ccfg, Options{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	// A small receive buffer keeps most of the response in the server's
	// send queue while the client does not read.
	if err := pr.held.Conn.(*net.TCPConn).SetReadBuffer(16 << 10); err != nil {
		t.Fatal(err)
	}
	const n = 192 << 10
	pr.server.SetWriteDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.Copy(pr.server, payload(7, n)); err != nil {
		t.Fatalf("the response does not fit in the socket buffers: %v", err)
	}
	closed := make(chan error, 1)
	go func() { closed <- closeConn(pr.server) }()
	time.Sleep(100 * time.Millisecond) // the server has closed, or is lingering
	pr.client.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := pr.client.Write([]byte("window update")); err != nil {
		t.Fatalf("client write: %v", err)
	}
	time.Sleep(100 * time.Millisecond) // the bytes reached the server
	h := sha256.New()
	got, readErr = io.Copy(h, pr.client)
	want, _, _ := sum256(payload(7, n))
	sumOK = got == n && [32]byte(h.Sum(nil)) == want
	pr.client.Close()
	select {
	case err := <-closed:
		if err != nil {
			t.Errorf("close: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("close did not return")
	}
	return got, sumOK, readErr
}

// TestCloseLingering: a lingering close delivers the whole queued response
// and a clean end although the client sends after the close began; a plain
// close, in the same situation, loses the response's tail to a RST (which
// is what CloseLingering is for: if this half stops failing, the test no
// longer shows anything).
func TestCloseLingering(t *testing.T) { closeLingering(t) }

// TestKernelCloseLingering is TestCloseLingering with TX and RX in the
// kernel: the close_notify goes through TLS_TX and the FIN follows it.
func TestKernelCloseLingering(t *testing.T) {
	kerneltest.Require(t)
	closeLingering(t)
}

func closeLingering(t *testing.T) {
	got, ok, err := lingerCase(t, func(c *Conn) error { return c.CloseLingering(5 * time.Second) })
	if err != nil || !ok {
		t.Errorf("lingering close: the client read %d bytes (intact: %v), then %v; want the whole response and a clean end", got, ok, err)
	}
	got, ok, err = lingerCase(t, (*Conn).Close)
	if err == nil || ok {
		t.Errorf("plain close: the client read %d bytes (intact: %v), then %v; want a reset before the end", got, ok, err)
	} else {
		t.Logf("plain close, for comparison: the client read %d bytes, then %v", got, err)
	}
}

// A client that never closes holds a lingering close for its timeout only.
func TestCloseLingeringTimeout(t *testing.T) {
	p := newTestPKI(t)
	scfg, ccfg := p.configs(connCase{version: tls.VersionTLS13, tickets: true})
	pr, err := dialPair(t, scfg, ccfg, Options{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := pr.server.CloseLingering(300 * time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d < 300*time.Millisecond {
		t.Errorf("CloseLingering returned after %v, before the client closed or its timeout", d)
	}
	// The client saw close_notify: a clean end.
	pr.client.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := pr.client.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Errorf("client read after the lingering close: %v, want EOF", err)
	}
}
