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

// TestKernelKeyWearRXInFlight: when the server asks the client to update,
// the client has far more than the limit's worth of records in flight
// (written, not yet read): they are sealed under the old key whatever the
// client does. On TLS 1.3 with kernel rekey every byte arrives, the client
// answers once it reads the request, and its records after the answer are
// opened under its new key; a margin of the limit alone would end the
// connection at twice the limit. Where the kernel cannot rekey, the read
// ends at the limit.
func TestKernelKeyWearRXInFlight(t *testing.T) {
	kerneltest.Require(t)
	p := newTestPKI(t)
	scfg, ccfg := p.configs(connCase{version: tls.VersionTLS13})
	server, client := kernelPeers(t, scfg, ccfg, Options{RecordLimit: wearLimit})
	if err := server.sock.SetReadBuffer(4 << 20); err != nil {
		t.Fatal(err)
	}
	if err := client.sock.SetWriteBuffer(4 << 20); err != nil {
		t.Fatal(err)
	}
	// Ten times the limit, in small records, all written before the
	// server reads one.
	const records = 10 * wearLimit
	chunks := make([][]byte, records)
	for i := range chunks {
		chunks[i] = make([]byte, 100)
		rand.Read(chunks[i])
	}
	want := bytes.Join(chunks, nil)
	for _, c := range chunks {
		if _, err := client.Write(c); err != nil {
			t.Fatal(err)
		}
	}
	before := Stats()
	got := make([]byte, len(want))
	_, readErr := io.ReadFull(server, got)
	if !Probe().Rekey {
		if !errors.Is(readErr, ErrKeyExhausted) {
			t.Fatalf("server read %v: want ErrKeyExhausted where the kernel cannot rekey", readErr)
		}
		return
	}
	if readErr != nil || !bytes.Equal(got, want) {
		t.Fatalf("server read %v, equal %v: want every in-flight record opened under the old key", readErr, bytes.Equal(got, want))
	}
	if sent := Stats().KeyUpdatesSent - before.KeyUpdatesSent; sent != 1 {
		t.Fatalf("%d KeyUpdates sent by both while the server read, want the server's one request", sent)
	}
	// The client reads the request behind the server's "go" and answers;
	// what it writes then is sealed under its new key.
	errc := make(chan error, 1)
	go func() {
		buf := make([]byte, 2)
		if _, err := io.ReadFull(client, buf); err != nil || string(buf) != "go" {
			errc <- fmt.Errorf("client read %q, %v", buf, err)
			return
		}
		_, err := client.Write([]byte("after the answer"))
		errc <- errors.Join(err, client.CloseWrite())
	}()
	if _, err := server.Write([]byte("go")); err != nil {
		t.Fatal(err)
	}
	after := make([]byte, len("after the answer"))
	_, err := io.ReadFull(server, after)
	seq, serr := server.kernelSeq(optTLSRX)
	rest, rerr := io.ReadAll(server)
	if cerr := <-errc; cerr != nil || err != nil || string(after) != "after the answer" || rerr != nil || len(rest) != 0 {
		t.Fatalf("client %v; server read %q, %v, then %d bytes, %v: want the client's record under its new key, then its end", cerr, after, err, len(rest), rerr)
	}
	if applied := Stats().KeyUpdates - before.KeyUpdates; applied < 2 {
		t.Fatalf("%d KeyUpdates applied by both, want the client's (the request) and the server's (the answer)", applied)
	}
	if serr != nil || seq != 1 {
		t.Fatalf("the client's new key had protected %d records (%v) when its first was read, want 1", seq, serr)
	}
}

// TestKernelNoAskAfterPeerClose: a request to update that the server has
// not sent yet when the peer's close_notify arrives is dropped. A peer that
// has sent close_notify cannot answer, and Go's crypto/tls then keeps its
// read key, so it would fail the MAC of every record behind the request.
// Where the kernel rekeys, the server's write lock is held while it reads
// (as a splice into the socket holds it), so the request its reads raise
// stays pending; its reply
// after the client's close_notify must reach the client whole. Where the
// kernel cannot rekey, the read ends at the limit and nothing is sent.
func TestKernelNoAskAfterPeerClose(t *testing.T) {
	kerneltest.Require(t)
	p := newTestPKI(t)
	scfg, ccfg := p.configs(connCase{version: tls.VersionTLS13})
	cliRaw, srvRaw := loopbackPair(t)
	server := Server(srvRaw, scfg, Options{RecordLimit: wearLimit, RequireOffload: true})
	client := tls.Client(cliRaw, ccfg)
	handshakeBoth(t, server, client)
	errc := make(chan error, 1)
	// 300 records: past the limit (the request), short of twice the limit
	// (where an unanswered request ends the connection).
	chunks := wearPayload()[:300]
	before := Stats()
	rekey := Probe().Rekey
	if rekey {
		server.writeMu.Lock()
	}
	go func() {
		for _, c := range chunks {
			if _, err := client.Write(c); err != nil {
				errc <- err
				return
			}
		}
		errc <- client.CloseWrite()
	}()
	var got bytes.Buffer
	_, readErr := io.Copy(&got, server)
	if !rekey {
		// Nothing to ask with: the read ends at the limit, no KeyUpdate sent.
		<-errc
		if sent := Stats().KeyUpdatesSent - before.KeyUpdatesSent; !errors.Is(readErr, ErrKeyExhausted) || sent != 0 {
			t.Fatalf("server read %v, %d KeyUpdates sent: want ErrKeyExhausted and none", readErr, sent)
		}
		return
	}
	server.writeMu.Unlock()
	if err := <-errc; err != nil || readErr != nil || !bytes.Equal(got.Bytes(), bytes.Join(chunks, nil)) {
		t.Fatalf("client write %v, server read %v, %d bytes: want every byte, then close_notify", err, readErr, got.Len())
	}
	reply := bytes.Repeat([]byte("reply after close_notify "), 4000)
	go func() {
		_, err := server.Write(reply)
		errc <- errors.Join(err, server.Close())
	}()
	back, clientErr := io.ReadAll(client)
	if err := <-errc; err != nil || clientErr != nil || !bytes.Equal(back, reply) {
		t.Fatalf("server write %v, client read %v, %d of %d bytes: want the reply whole", err, clientErr, len(back), len(reply))
	}
	if sent := Stats().KeyUpdatesSent - before.KeyUpdatesSent; sent != 0 {
		t.Fatalf("%d KeyUpdates sent after the peer's close_notify: want the request dropped", sent)
	}
}
