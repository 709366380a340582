package ktls

import (
	"bytes"
	"crypto/tls"
	"io"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"golang.org/x/sys/unix"
)

// TestKernelReadPartialRecordStall: a Read that waits for a record whose
// first part is queued asks the kernel again, so the parser's check that
// copies a partial record out of a full receive buffer runs after the
// buffer filled. The check is made true with no arrival, by shrinking
// SO_RCVBUF under the queued part (memory pressure): the one thing a
// delayed ACK that closes the window does too. Without the retry the part
// stays in TCP's queue for good (SIOCINQ), as it did behind a closed
// window in a moved tunnel.
func TestKernelReadPartialRecordStall(t *testing.T) {
	kerneltest.Require(t)
	p := newTestPKI(t)
	for _, tc := range []struct {
		name    string
		version uint16
	}{{"tls13", tls.VersionTLS13}, {"tls12", tls.VersionTLS12}} {
		t.Run(tc.name, func(t *testing.T) {
			checkNoFDLeak(t, kerneltest.OpenFDs)
			scfg, ccfg := p.configs(connCase{version: tc.version})
			ccfg.DynamicRecordSizingDisabled = true // full records
			pr, err := dialPair(t, scfg, ccfg, Options{}, nil)
			if err != nil {
				t.Fatal(err)
			}
			if off := pr.server.Offload(); off.RX != ModeSW {
				t.Fatalf("RX mode %v, want sw", off.RX)
			}
			const size = 1 << 14
			data := make([]byte, 2*size)
			rand.NewChaCha8([32]byte{7}).Read(data)
			wire := sealed(t, pr, data)
			recLen := len(wire) / 2 // two full records of equal length
			part := recLen / 2

			// The first record and half of the second.
			if _, err := pr.held.Conn.Write(wire[:recLen+part]); err != nil {
				t.Fatal(err)
			}
			got := make([]byte, 2*size)
			if _, err := io.ReadFull(pr.server, got[:size]); err != nil {
				t.Fatalf("first record: %v", err)
			}
			before := Stats().PartialRecordRetries
			done := make(chan error, 1)
			go func() {
				_, err := io.ReadFull(pr.server, got[size:])
				done <- err
			}()
			kerneltest.WaitIOWait(t, "ktls.(*Conn).Read")
			fd := kerneltest.SocketFD(t, pr.server)
			if q := kerneltest.Inq(t, fd); q != part {
				t.Fatalf("SIOCINQ %d, want the second record's first %d bytes", q, part)
			}
			if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, 1024); err != nil {
				t.Fatal(err)
			}
			for deadline := time.Now().Add(15 * time.Second); kerneltest.Inq(t, fd) != 0; time.Sleep(10 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("the partial record is still in TCP's queue (SIOCINQ %d) 15 s after the buffer filled: the reader never asked again", kerneltest.Inq(t, fd))
				}
			}
			if got := Stats().PartialRecordRetries - before; got < 1 {
				t.Errorf("PartialRecordRetries moved by %d, want 1 or more", got)
			}
			if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, 1<<20); err != nil {
				t.Fatal(err)
			}
			if _, err := pr.held.Conn.Write(wire[recLen+part:]); err != nil {
				t.Fatal(err)
			}
			select {
			case err := <-done:
				if err != nil {
					t.Fatalf("second record: %v", err)
				}
			case <-time.After(time.Minute):
				t.Fatal("the second record never completed")
			}
			if !bytes.Equal(got, data) {
				t.Fatal("the bytes read differ from the bytes sent")
			}
		})
	}
}

// sealed returns the records the client seals for data, unsent.
func sealed(t *testing.T, pr *pair, data []byte) []byte {
	t.Helper()
	pr.held.mu.Lock()
	pr.held.hold = true
	pr.held.mu.Unlock()
	if _, err := pr.client.Write(data); err != nil {
		t.Fatal(err)
	}
	pr.held.mu.Lock()
	defer pr.held.mu.Unlock()
	wire := bytes.Clone(pr.held.buf.Bytes())
	pr.held.buf.Reset()
	pr.held.hold = false
	return wire
}
