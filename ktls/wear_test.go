package ktls

import (
	"bytes"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"testing"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
)

// wearLimit is the test's Options.RecordLimit: low enough that a few MiB
// wear several keys out.
const wearLimit = 256

// wearPayload is 700 writes of 3,001 bytes: at least 700 records, more
// than two keys' worth at wearLimit.
func wearPayload() [][]byte {
	chunks := make([][]byte, 700)
	for i := range chunks {
		chunks[i] = make([]byte, 3001)
		rand.Read(chunks[i])
	}
	return chunks
}

// TestKernelKeyWearTX: the server seals more records than its record limit.
// On TLS 1.3 with kernel rekey every byte arrives across KeyUpdates it
// sends by itself; otherwise its Write fails with ErrKeyExhausted before
// the key seals record limit + 1, and the client reads internal_error.
func TestKernelKeyWearTX(t *testing.T) {
	kerneltest.Require(t)
	for _, version := range []uint16{tls.VersionTLS13, tls.VersionTLS12} {
		t.Run(tls.VersionName(version), func(t *testing.T) {
			p := newTestPKI(t)
			scfg, ccfg := p.configs(connCase{version: version})
			var events []Event
			server, client := kernelPeers(t, scfg, ccfg, Options{RecordLimit: wearLimit, Observer: func(e Event) { events = append(events, e) }})
			chunks := wearPayload()
			before := Stats()
			var got bytes.Buffer
			var readErr, writeErr error
			d := statDelta(t, func() {
				done := make(chan struct{})
				go func() {
					defer close(done)
					_, readErr = io.Copy(&got, client)
				}()
				for _, c := range chunks {
					if _, writeErr = server.Write(c); writeErr != nil {
						break
					}
				}
				if writeErr != nil {
					server.Abort()
				} else {
					server.Close()
				}
				<-done
			})
			sent, applied := Stats().KeyUpdatesSent-before.KeyUpdatesSent, Stats().KeyUpdates-before.KeyUpdates
			want := bytes.Join(chunks, nil)
			if version == tls.VersionTLS13 && Probe().Rekey {
				if writeErr != nil || readErr != nil || !bytes.Equal(got.Bytes(), want) {
					t.Fatalf("write %v, read %v, %d of %d bytes, equal %v: want every byte across the rekeys",
						writeErr, readErr, got.Len(), len(want), bytes.Equal(got.Bytes(), want))
				}
				// 700+ records at most 256 - 66 apart: at least 3 updates.
				if sent < 3 || applied != sent || d["TlsTxRekeyOk"] != int64(sent) || d["TlsRxRekeyOk"] != int64(sent) {
					t.Fatalf("KeyUpdates sent %d, applied by the client %d, tls_stat %v: want >= 3, equal, and the kernel's rekeys", sent, applied, d)
				}
				return
			}
			var alert AlertError
			if !errors.Is(writeErr, ErrKeyExhausted) || !errors.As(readErr, &alert) || alert != alertInternalError {
				t.Fatalf("write %v, client read %v: want ErrKeyExhausted, then internal_error at the client", writeErr, readErr)
			}
			if got.Len() == 0 || !bytes.Equal(got.Bytes(), want[:got.Len()]) {
				t.Fatalf("the client got %d bytes, not a prefix of what was sent", got.Len())
			}
			if sent != 0 || len(events) == 0 || events[len(events)-1].Kind != EventKeyExhausted {
				t.Fatalf("%d KeyUpdates sent, events %v: want none, and a key-exhausted event", sent, events)
			}
			// Every record the client opened came before the limit: at
			// least one per write, and its records are full-size.
			if records := got.Len() / 3001; records > wearLimit {
				t.Fatalf("the client received %d writes' records under one key, limit %d", records, wearLimit)
			}
		})
	}
}

// TestKernelKeyWearRX: the client seals more records than the server's
// record limit. On TLS 1.3 with kernel rekey the server asks it to update
// (the client reads meanwhile, as any peer does) and every byte arrives;
// otherwise the server's Read fails with ErrKeyExhausted at the limit and
// the client reads internal_error.
func TestKernelKeyWearRX(t *testing.T) {
	kerneltest.Require(t)
	for _, version := range []uint16{tls.VersionTLS13, tls.VersionTLS12} {
		t.Run(tls.VersionName(version), func(t *testing.T) {
			p := newTestPKI(t)
			scfg, ccfg := p.configs(connCase{version: version})
			server, client := kernelPeers(t, scfg, ccfg, Options{RecordLimit: wearLimit})
			// What is in flight when the server asks for an update is sealed
			// under the old key whatever the client does: small buffers keep
			// it (about 30 records) well inside the limit's margin, as
			// socket buffers are inside the default limit's 2^23 records.
			if err := server.sock.SetReadBuffer(32 << 10); err != nil {
				t.Fatal(err)
			}
			if err := client.sock.SetWriteBuffer(32 << 10); err != nil {
				t.Fatal(err)
			}
			chunks := wearPayload()
			before := Stats()
			var got bytes.Buffer
			var readErr, clientReadErr error
			clientDone := make(chan struct{})
			go func() {
				defer close(clientDone)
				_, clientReadErr = io.Copy(io.Discard, client)
			}()
			writeDone := make(chan struct{})
			go func() {
				defer close(writeDone)
				for _, c := range chunks {
					if _, err := client.Write(c); err != nil {
						return
					}
				}
				client.CloseWrite()
			}()
			// Through Read, 32 KiB at a time (WriteTo checks per MiB).
			buf := make([]byte, 32<<10)
			for readErr == nil {
				var n int
				n, readErr = server.Read(buf)
				got.Write(buf[:n])
			}
			if readErr == io.EOF {
				readErr = nil
			}
			server.Close()
			<-writeDone
			<-clientDone
			sent, applied := Stats().KeyUpdatesSent-before.KeyUpdatesSent, Stats().KeyUpdates-before.KeyUpdates
			want := bytes.Join(chunks, nil)
			if version == tls.VersionTLS13 && Probe().Rekey {
				if readErr != nil || !bytes.Equal(got.Bytes(), want) {
					t.Fatalf("read %v, %d of %d bytes, equal %v: want every byte across the peer's rekeys", readErr, got.Len(), len(want), bytes.Equal(got.Bytes(), want))
				}
				// The server asks (one KeyUpdate sent each time), the client
				// answers (one sent, applied by the server; the server
				// applies the client's).
				if sent < 4 || applied < 2 {
					t.Fatalf("%d KeyUpdates sent by both, %d applied by both: want the server's requests and the client's answers", sent, applied)
				}
				return
			}
			var alert AlertError
			if !errors.Is(readErr, ErrKeyExhausted) || !errors.As(clientReadErr, &alert) || alert != alertInternalError {
				t.Fatalf("server read %v, client read %v: want ErrKeyExhausted, and internal_error at the client", readErr, clientReadErr)
			}
			if !bytes.Equal(got.Bytes(), want[:got.Len()]) {
				t.Fatalf("the server got %d bytes, not a prefix of what was sent", got.Len())
			}
			// A read takes what the kernel has opened: at most one read
			// (32 KiB of io.Copy's buffer, about 11 of these records) past
			// the limit.
			if records := got.Len() / 3001; records > wearLimit+11 {
				t.Fatalf("the server returned %d writes' records under one key, limit %d", records, wearLimit)
			}
			if sent != 0 {
				t.Fatal(fmt.Sprintf("%d KeyUpdates sent: want none where none can be installed", sent))
			}
		})
	}
}
