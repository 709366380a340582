package splice

import (
	"bytes"
	"crypto/sha256"
	"crypto/tls"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/testpki"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"golang.org/x/sys/unix"
)

// TestKernelRelayPartialRecordStall: a spliced direction whose kTLS source
// holds the first part of a record asks the kernel again while it waits, so
// the parser's check that copies a partial record out of a full receive
// buffer runs after the buffer filled. The check is made true with no
// arrival, by shrinking SO_RCVBUF under the queued part (memory pressure),
// as the delayed ACK that closed the window did when a moved tunnel
// stalled. Without the retry the part stays in TCP's queue for good
// (SIOCINQ) and the direction never moves again.
func TestKernelRelayPartialRecordStall(t *testing.T) {
	kerneltest.Require(t)
	checkLeaks(t)
	ktls.Probe()
	ca := testpki.NewCA(t, "splice test CA")
	srvCfg := &tls.Config{Certificates: []tls.Certificate{ca.Server(t).TLS}}
	cliCfg := &tls.Config{RootCAs: ca.Pool, ServerName: "localhost", DynamicRecordSizingDisabled: true}
	cliRaw, srvRaw := tcpPair(t)
	held := &capturingConn{TCPConn: cliRaw}
	tp := handshakeTopology(t, ktls.Server(srvRaw, srvCfg, ktls.Options{}), tls.Client(held, cliCfg))
	if off := tp.server.Offload(); off.RX != ktls.ModeSW {
		t.Fatalf("RX mode %v, want sw", off.RX)
	}
	tun := New(tp.server, tp.relayB, Options{Pipes: newTestPool(t, 2)})
	wait := runRelay(t.Context(), tun)

	const size = 1 << 14
	data := make([]byte, 2*size)
	rand.NewChaCha8([32]byte{9}).Read(data)
	wire := held.capture(t, func() error { _, err := tp.gateway.Write(data); return err })
	recLen := len(wire) / 2 // two full records of equal length
	part := recLen / 2

	// The first record and half of the second.
	if _, err := cliRaw.Write(wire[:recLen+part]); err != nil {
		t.Fatal(err)
	}
	if got, want := readExact(t, tp.upstream, size), sha256.Sum256(data[:size]); !bytes.Equal(got, want[:]) {
		t.Fatal("the first record's bytes differ")
	}
	// The gateway→upstream direction runs on Run's own goroutine.
	kerneltest.WaitIOWait(t, "splice.(*Relay).spliceLoop", "splice.(*Relay).Run(")
	fd := kerneltest.SocketFD(t, tp.server)
	if q := kerneltest.Inq(t, fd); q != part {
		t.Fatalf("SIOCINQ %d, want the second record's first %d bytes", q, part)
	}
	before := ktls.Stats().PartialRecordRetries
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, 1024); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(15 * time.Second); kerneltest.Inq(t, fd) != 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the partial record is still in TCP's queue (SIOCINQ %d) 15 s after the buffer filled: the relay never asked again", kerneltest.Inq(t, fd))
		}
	}
	if got := ktls.Stats().PartialRecordRetries - before; got < 1 {
		t.Errorf("PartialRecordRetries moved by %d, want 1 or more", got)
	}
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, 1<<20); err != nil {
		t.Fatal(err)
	}
	if _, err := cliRaw.Write(wire[recLen+part:]); err != nil {
		t.Fatal(err)
	}
	if got, want := readExact(t, tp.upstream, size), sha256.Sum256(data[size:]); !bytes.Equal(got, want[:]) {
		t.Fatal("the second record's bytes differ")
	}

	// Both ends close; the relay counts every byte, all spliced.
	if err := tp.gateway.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(io.Discard, tp.upstream); err != nil {
		t.Fatal(err)
	}
	tp.upstream.CloseWrite()
	if _, err := io.Copy(io.Discard, tp.gateway); err != nil {
		t.Fatal(err)
	}
	res, err := wait()
	if err != nil {
		t.Fatalf("relay: %v", err)
	}
	// close_notify is the one control record.
	if a := res.Dir(AToB); a.Bytes != 2*size || a.SpliceBytes != 2*size || a.ControlRecords != 1 || a.End != EndEOF {
		t.Errorf("gateway→upstream %+v, want %d bytes, all spliced, 1 control record, EOF", a, 2*size)
	}
}

// capturingConn keeps what is written during capture instead of sending it.
type capturingConn struct {
	*net.TCPConn
	mu  sync.Mutex
	buf *bytes.Buffer
}

func (c *capturingConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.buf != nil {
		return c.buf.Write(p)
	}
	return c.TCPConn.Write(p)
}

// capture returns the bytes write writes, unsent.
func (c *capturingConn) capture(t *testing.T, write func() error) []byte {
	t.Helper()
	c.mu.Lock()
	c.buf = new(bytes.Buffer)
	c.mu.Unlock()
	err := write()
	c.mu.Lock()
	b := c.buf.Bytes()
	c.buf = nil
	c.mu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	return b
}
