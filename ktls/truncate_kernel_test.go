package ktls

import (
	"bytes"
	"errors"
	"io"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
)

// sealHeld returns the records the pair's client seals for msg, written to
// the held buffer instead of the socket.
func sealHeld(t *testing.T, p *pair, msg []byte) []byte {
	t.Helper()
	p.held.mu.Lock()
	p.held.hold = true
	p.held.mu.Unlock()
	if _, err := p.client.Write(msg); err != nil {
		t.Fatal(err)
	}
	p.held.mu.Lock()
	defer p.held.mu.Unlock()
	out := bytes.Clone(p.held.buf.Bytes())
	p.held.buf.Reset()
	return out
}

// TestKernelTruncatedRecordNoDecryptError: a peer that stops in the middle
// of a record (its FIN, or its reset, after part of the record) never makes
// the kernel decrypt the part, so TlsDecryptError stays put and the reader
// sees the end (io.EOF) or the reset, never the partial bytes. The kernel
// counts a decrypt error only for a whole record that fails authentication:
// here the part of a record completed by the first bytes of the next one,
// as a sender that writes a new record after a partial write would cause.
func TestKernelTruncatedRecordNoDecryptError(t *testing.T) {
	kerneltest.Require(t)
	msg := bytes.Repeat([]byte{0x5a}, 64)
	for _, tc := range []struct {
		name string
		// send writes the wire bytes of the truncated stream on raw,
		// given the client's next two records a and b.
		send       func(t *testing.T, raw *net.TCPConn, a, b []byte)
		wantDecErr int64
		check      func(t *testing.T, n int, err error)
	}{
		{
			name: "fin",
			send: func(t *testing.T, raw *net.TCPConn, a, _ []byte) {
				raw.Write(a[:len(a)/2])
				if err := raw.CloseWrite(); err != nil {
					t.Fatal(err)
				}
			},
			check: func(t *testing.T, n int, err error) {
				if n != 0 || err != io.EOF {
					t.Errorf("Read after half a record and FIN: %d bytes, %v; want 0, io.EOF", n, err)
				}
			},
		},
		{
			name: "reset",
			send: func(t *testing.T, raw *net.TCPConn, a, _ []byte) {
				raw.Write(a[:len(a)/2])
				// The half record must be in the server's queue before
				// the reset, which would otherwise drop it in flight.
				time.Sleep(100 * time.Millisecond)
				raw.SetLinger(0)
				raw.Close()
			},
			check: func(t *testing.T, n int, err error) {
				if n != 0 || !errors.Is(err, syscall.ECONNRESET) {
					t.Errorf("Read after half a record and a reset: %d bytes, %v; want 0, ECONNRESET", n, err)
				}
			},
		},
		{
			name: "completed-by-next-record",
			send: func(t *testing.T, raw *net.TCPConn, a, b []byte) {
				raw.Write(append(bytes.Clone(a[:len(a)-8]), b...))
				raw.CloseWrite()
			},
			wantDecErr: 1,
			check: func(t *testing.T, n int, err error) {
				if n != 0 || !IsBadRecord(err) {
					t.Errorf("Read of a record completed by the next one: %d bytes, %v; want 0, EBADMSG", n, err)
				}
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := tls13Pair(t)
			a, b := sealHeld(t, p, msg), sealHeld(t, p, msg)
			if len(a) != recordHeaderLen+len(msg)+1+16 || len(b) != len(a) {
				t.Fatalf("sealed %d and %d bytes, want one record of %d each", len(a), len(b), recordHeaderLen+len(msg)+1+16)
			}
			var (
				n   int
				err error
			)
			d := statDelta(t, func() {
				tc.send(t, p.held.Conn.(*net.TCPConn), a, b)
				p.server.SetReadDeadline(time.Now().Add(time.Minute))
				n, err = p.server.Read(make([]byte, 2*len(msg)))
			})
			tc.check(t, n, err)
			wantStat(t, d, "TlsDecryptError", tc.wantDecErr)
		})
	}
}

// TestKernelGoClientCloseAfterFailedWrite: crypto/tls seals a record (and
// spends its sequence number) before it writes it, and Close sends
// close_notify even after a Write failed. A client whose Write fails on its
// deadline before any byte left (the record sealed, not sent) then seals
// its close_notify under the next sequence number, which the receiving
// kernel cannot authenticate: TlsDecryptError +1 and EBADMSG for a peer
// that did nothing wrong of its own. A Write that succeeds leaves the
// close_notify in sequence: io.EOF, CloseNotified, no decrypt error.
func TestKernelGoClientCloseAfterFailedWrite(t *testing.T) {
	kerneltest.Require(t)
	msg := bytes.Repeat([]byte{0x5a}, 64)
	for _, failed := range []bool{false, true} {
		name := "write-then-close"
		if failed {
			name = "write-past-deadline-then-close"
		}
		t.Run(name, func(t *testing.T) {
			p := tls13Pair(t)
			var (
				n       int
				err     error
				got     []byte
				wantMsg []byte
			)
			d := statDelta(t, func() {
				if failed {
					p.client.SetWriteDeadline(time.Now().Add(-time.Second))
					if _, werr := p.client.Write(msg); !isTimeout(werr) {
						t.Fatalf("Write past the deadline: %v, want a timeout", werr)
					}
				} else {
					if _, werr := p.client.Write(msg); werr != nil {
						t.Fatal(werr)
					}
					wantMsg = msg
				}
				if cerr := p.client.Close(); cerr != nil {
					t.Fatalf("client Close: %v", cerr)
				}
				p.server.SetReadDeadline(time.Now().Add(time.Minute))
				got, err = io.ReadAll(p.server)
				n = len(got)
			})
			if !bytes.Equal(got, wantMsg) {
				t.Errorf("server read %d bytes %x, want %x", n, got, wantMsg)
			}
			if failed {
				if !IsBadRecord(err) || p.server.CloseNotified() {
					t.Errorf("server Read after the client's failed Write and Close: %v (close_notify read %v), want EBADMSG", err, p.server.CloseNotified())
				}
				wantStat(t, d, "TlsDecryptError", 1)
				return
			}
			if err != nil || !p.server.CloseNotified() {
				t.Errorf("server Read to the end: %v (close_notify read %v), want io.EOF after close_notify", err, p.server.CloseNotified())
			}
			wantStat(t, d, "TlsDecryptError", 0)
		})
	}
}
