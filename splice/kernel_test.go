package splice

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/testpki"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// ktlsTopology is gateway (Go TLS client) → kTLS server conn (tunnel side a)
// → tunnel → relayB → upstream, all on loopback.
type ktlsTopology struct {
	gateway  *tls.Conn
	server   *ktls.Conn
	relayB   *net.TCPConn
	upstream *net.TCPConn
}

func newKTLSTopology(t *testing.T, version uint16, opts ktls.Options) ktlsTopology {
	t.Helper()
	ca := testpki.NewCA(t, "splice test CA")
	srvCfg := &tls.Config{Certificates: []tls.Certificate{ca.Server(t).TLS}}
	cliCfg := &tls.Config{RootCAs: ca.Pool, ServerName: "localhost", MinVersion: version, MaxVersion: version}
	cliRaw, srvRaw := tcpPair(t)
	return handshakeTopology(t, ktls.Server(srvRaw, srvCfg, opts), tls.Client(cliRaw, cliCfg))
}

// handshakeTopology completes the handshakes of server and gateway, one
// connection's two ends, and adds the tunnel's far side (relayB, upstream).
func handshakeTopology(t *testing.T, server *ktls.Conn, gateway *tls.Conn) ktlsTopology {
	t.Helper()
	hsErr := make(chan error, 1)
	go func() { hsErr <- gateway.Handshake() }()
	if err := server.Handshake(); err != nil {
		t.Fatalf("kTLS server handshake: %v", err)
	}
	if err := <-hsErr; err != nil {
		t.Fatalf("client handshake: %v", err)
	}
	t.Cleanup(func() { gateway.Close(); server.Close() })
	tp := ktlsTopology{gateway: gateway, server: server}
	tp.relayB, tp.upstream = tcpPair(t)
	return tp
}

// TestKernelRelayEcho: size bytes each way through a kTLS server conn and the
// relay to an echo upstream and back, for TLS 1.3 and 1.2, with RX in the
// kernel (both directions spliced) and with RX kept in userspace (the
// gateway→upstream direction copies, the other still splices into kTLS TX).
// The gateway's close_notify reaches the relay as a control record.
func TestKernelRelayEcho(t *testing.T) {
	kerneltest.Require(t)
	size := int64(kerneltest.BulkMiB(t, 4)) * MiB // KTLS_TEST_MIB
	// The first offload probes the kernel on throwaway sockets (cached for
	// the process); keep those installs out of the counted deltas.
	ktls.Probe()
	for _, tc := range []struct {
		name      string
		version   uint16
		disableRX bool
	}{
		{"tls13", tls.VersionTLS13, false},
		{"tls12", tls.VersionTLS12, false},
		{"tls13-rx-userspace", tls.VersionTLS13, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			checkLeaks(t)
			pool := newTestPool(t, 2)
			var res Stats
			var err error
			// The delta spans the handshake (where the keys go into the
			// kernel) and the close (where the kernel drops them).
			delta := kerneltest.StatDelta(t, func() {
				tp := newKTLSTopology(t, tc.version, ktls.Options{RequireOffload: true, DisableRX: tc.disableRX})
				res, err = echoThrough(t, tp, New(tp.server, tp.relayB, Options{Pipes: pool}), size)
			})
			if err != nil {
				t.Fatal(err)
			}
			in, out := res.AToB, res.BToA
			t.Logf("gateway->upstream %+v; upstream->gateway %+v; tls_stat delta %v", in, out, delta)
			if out.Bytes != size || !out.Spliced || out.SpliceBytes != size || out.End != EndEOF {
				t.Errorf("upstream->gateway %+v, want %d bytes spliced into kTLS TX", out, size)
			}
			if tc.disableRX {
				if in.Bytes != size || in.Spliced || in.CopyBytes != size || in.End != EndEOF {
					t.Errorf("gateway->upstream %+v, want %d bytes copied (RX in userspace)", in, size)
				}
			} else {
				// close_notify is the one control record; it carries no data.
				if in.Bytes != size || !in.Spliced || in.SpliceBytes != size || in.ControlRecords != 1 || in.End != EndEOF {
					t.Errorf("gateway->upstream %+v, want %d bytes spliced from kTLS RX and 1 control record", in, size)
				}
			}
			if delta["TlsTxSw"] != 1 {
				t.Errorf("TlsTxSw moved by %d, want 1", delta["TlsTxSw"])
			}
			if want := map[bool]int64{false: 1, true: 0}[tc.disableRX]; delta["TlsRxSw"] != want {
				t.Errorf("TlsRxSw moved by %d, want %d", delta["TlsRxSw"], want)
			}
			if delta["TlsCurrTxSw"] != 0 || delta["TlsCurrRxSw"] != 0 {
				t.Errorf("kTLS sockets left open: TlsCurrTxSw %+d, TlsCurrRxSw %+d", delta["TlsCurrTxSw"], delta["TlsCurrRxSw"])
			}
			if delta["TlsDecryptError"] != 0 {
				t.Errorf("TlsDecryptError moved by %d", delta["TlsDecryptError"])
			}
		})
	}
}

// echoThrough runs the tunnel, sends size bytes from the gateway, lets the
// upstream echo them, and checks what the gateway gets back.
func echoThrough(t *testing.T, tp ktlsTopology, tun *Relay, size int64) (Stats, error) {
	wait := runRelay(t.Context(), tun)
	var wg sync.WaitGroup
	var upErr, sendErr error
	var sent []byte
	wg.Go(func() { upErr = echoUpstream(tp.upstream) })
	wg.Go(func() {
		sent, sendErr = sendStream(tp.gateway, 7, size)
		if sendErr == nil {
			sendErr = tp.gateway.CloseWrite() // close_notify
		}
	})
	got, gotSum, recvErr := recvStream(tp.gateway)
	wg.Wait()
	res, relayErr := wait()
	if err := errors.Join(upErr, sendErr, recvErr, relayErr); err != nil {
		return res, err
	}
	if got != size || !bytes.Equal(gotSum, sent) {
		return res, errors.New("echo through kTLS: digest or size mismatch")
	}
	return res, nil
}

// TestKernelRelayKeyUpdate: openssl s_client sends KeyUpdate(update_requested)
// in the middle of a spliced stream (its "K" command). On a kernel that can
// rekey kTLS (>= 6.14) the record is handled by the conn's userspace path,
// the relay resumes splicing with the new RX key, and bytes spliced back into
// kTLS TX after the conn's answering KeyUpdate still decrypt at the client.
// On older kernels the relay must fail with the conn's clear error.
func TestKernelRelayKeyUpdate(t *testing.T) {
	kerneltest.Require(t)
	openssl, err := exec.LookPath("openssl")
	if err != nil {
		if kerneltest.Required() {
			t.Fatalf("openssl not found: %v", err)
		}
		t.Skipf("SKIP: openssl not found: %v", err)
	}
	rekey := ktls.Probe().Rekey // before checkLeaks: the probe is cached for the process
	checkLeaks(t)
	ca := testpki.NewCA(t, "splice keyupdate CA")
	caFile := ca.WriteFile(t, t.TempDir(), "ca")
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()

	cmd := exec.CommandContext(t.Context(), openssl, "s_client", "-connect", ln.Addr().String(),
		"-tls1_3", "-servername", "localhost", "-CAfile", caFile)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = io.Discard
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		cmd.Process.Kill()
		cmd.Wait() // closes stdin and stdout
	}()
	raw, err := ln.AcceptTCP()
	if err != nil {
		t.Fatal(err)
	}
	server := ktls.Server(raw, &tls.Config{Certificates: []tls.Certificate{ca.Server(t).TLS}}, ktls.Options{RequireOffload: true})
	defer server.Close()
	if err := server.HandshakeContext(t.Context()); err != nil {
		t.Fatalf("kTLS handshake with openssl: %v", err)
	}
	relayB, upstream := tcpPair(t)
	pool := newTestPool(t, 2)
	var res Stats
	var relayErr error
	delta := kerneltest.StatDelta(t, func() {
		wait := runRelay(t.Context(), New(server, relayB, Options{Pipes: pool}))
		lines := bufio.NewScanner(stdout)
		// s_client reads stdin in chunks and treats a chunk starting with
		// "K" as its KeyUpdate command: data chunks are digits only.
		block1 := digits(64<<10, '1')
		block2 := digits(64<<10, '2')
		stdin.Write(block1)
		if got := readN(t, upstream, len(block1)); !bytes.Equal(got, block1) {
			t.Fatal("block before KeyUpdate corrupted")
		}
		stdin.Write([]byte("K\n"))
		time.Sleep(200 * time.Millisecond) // a separate stdin chunk for the command
		stdin.Write(block2)
		if !rekey {
			res, relayErr = wait()
			return
		}
		if got := readN(t, upstream, len(block2)); !bytes.Equal(got, block2) {
			t.Fatal("block after KeyUpdate corrupted")
		}
		// The conn answered with its own KeyUpdate and rotated TX; a reply
		// spliced into kTLS TX now must decrypt at openssl.
		const pong = "PONG-after-keyupdate"
		upstream.Write([]byte(pong + "\n"))
		found := false
		for lines.Scan() {
			if strings.Contains(lines.Text(), pong) {
				found = true
				break
			}
		}
		if !found {
			t.Error("openssl never printed the reply sent after the KeyUpdate")
		}
		stdin.Close() // s_client sends close_notify and exits
		if rest, err := io.ReadAll(upstream); err != nil || len(rest) != 0 {
			t.Errorf("upstream after close_notify: %d more bytes, %v; want EOF", len(rest), err)
		}
		upstream.CloseWrite()
		res, relayErr = wait()
	})
	t.Logf("rekey=%v result %+v err %v tls_stat delta %v", rekey, res, relayErr, delta)
	if !rekey {
		if !errors.Is(relayErr, ktls.ErrRekeyUnsupported) || res.AToB.End != EndError {
			t.Fatalf("relay on a kernel without kTLS rekey: %v, want ErrRekeyUnsupported", relayErr)
		}
		return
	}
	if relayErr != nil {
		t.Fatal(relayErr)
	}
	// The conn's Read that consumes the KeyUpdate may go on to return the
	// data record behind it: those bytes are copied, the rest spliced.
	in := res.AToB
	if in.Bytes != 128<<10 || in.SpliceBytes+in.CopyBytes != in.Bytes || in.SpliceBytes == 0 || in.ControlRecords < 2 || in.End != EndEOF {
		t.Errorf("openssl->upstream %+v, want 128 KiB mostly spliced, KeyUpdate and close_notify as control records", in)
	}
	if delta["TlsRxRekeyOk"] < 1 || delta["TlsTxRekeyOk"] < 1 {
		t.Errorf("tls_stat rekey counters %v, want TlsRxRekeyOk and TlsTxRekeyOk >= 1", delta)
	}
}

// digits returns n bytes of ASCII digits d, newline-terminated lines.
func digits(n int, d byte) []byte {
	b := bytes.Repeat([]byte{d}, n)
	for i := 63; i < n; i += 64 {
		b[i] = '\n'
	}
	b[n-1] = '\n'
	return b
}

// TestKernelRelayFullKTLSSink: a kTLS sink whose send buffer holds less than
// one record (as TCP memory pressure shrinks any socket's) still takes the
// whole stream. On kernels before 6.5 the record sealed last sits in TCP,
// queued and not sent, when the splice finds no room for the next one; the
// relay pushes it before it waits, or the direction waits forever.
func TestKernelRelayFullKTLSSink(t *testing.T) {
	kerneltest.Require(t)
	ktls.Probe()
	checkLeaks(t)
	tp := newKTLSTopology(t, tls.VersionTLS13, ktls.Options{RequireOffload: true})
	// The kernel doubles the value and raises it to its minimum (4,608
	// bytes): less than one 16 KiB record.
	if err := tp.server.NetConn().(*net.TCPConn).SetWriteBuffer(1); err != nil {
		t.Fatal(err)
	}
	size := int64(kerneltest.BulkMiB(t, 1)) * MiB
	wait := runRelay(t.Context(), New(tp.server, tp.relayB, Options{Pipes: newTestPool(t, 1)}))
	sent := goSend(tp.upstream, size, 11)
	// A stalled direction turns into a failed read here, not a hung test.
	tp.gateway.SetReadDeadline(time.Now().Add(2 * time.Minute))
	got := readExact(t, tp.gateway, size)
	if !bytes.Equal(got, sent(t)) {
		t.Fatal("upstream→gateway through a full kTLS sink: digest mismatch")
	}
	tp.upstream.CloseWrite()
	if err := tp.gateway.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if n, err := io.Copy(io.Discard, tp.upstream); err != nil || n != 0 {
		t.Fatalf("upstream read %d bytes, %v; want EOF only", n, err)
	}
	res, err := wait()
	if err != nil {
		t.Fatal(err)
	}
	if out := res.BToA; out.Bytes != size || !out.Spliced || out.SpliceBytes != size {
		t.Errorf("upstream->gateway %+v, want %d bytes spliced into kTLS TX", out, size)
	}
}

// TestKernelRelayKeyWear: a kTLS tunnel whose record limit is tiny renews
// its keys many times while bytes stream through the relay: the TX key
// before nearly every splice into the socket (BeginSeal), the RX key at the
// gateway's answer to each request to update. Every byte arrives exact, and
// neither the kernel nor the gateway (Go's crypto/tls, which opens what the
// kernel sealed) fails a record. "both-ways" streams both ways at once;
// "downstream" streams upstream → gateway only. The kTLS socket's send
// buffer is small, as TestKernelKeyWearRX's: a request to update reaches
// the gateway behind what that buffer holds, which must stay well inside
// the limit's margin (as socket buffers are inside the default limit's
// 2^23 records); and the splices into the socket end short (part of the
// pipe moved, then EAGAIN), so renewals meet a sink with no room.
//
// On a kernel that cannot rekey, the first splice into the socket would take
// the key past the limit (one splice's margin exceeds 64 records): the
// direction fails with ErrKeyExhausted before it seals a byte, and the
// gateway reads internal_error.
func TestKernelRelayKeyWear(t *testing.T) {
	kerneltest.Require(t)
	size := int64(kerneltest.BulkMiB(t, 4)) * MiB
	if !ktls.Probe().Rekey {
		checkLeaks(t)
		pool := newTestPool(t, 2)
		tp, _ := wearTopology(t, 16<<10)
		res, err := downstreamThrough(t, tp, New(tp.server, tp.relayB, Options{Pipes: pool}), size)
		// crypto/tls reports a peer's alert only in text.
		if !errors.Is(res.BToA.Err, ktls.ErrKeyExhausted) || res.BToA.Bytes != 0 || err == nil || !strings.Contains(err.Error(), "remote error: tls: internal error") {
			t.Fatalf("upstream->gateway %+v, error %v: want ErrKeyExhausted with nothing sealed, and internal_error at the gateway", res.BToA, err)
		}
		return
	}
	for _, tc := range []struct {
		name     string
		bothWays bool
	}{{"both-ways", true}, {"downstream", false}} {
		t.Run(tc.name, func(t *testing.T) {
			checkLeaks(t)
			pool := newTestPool(t, 2)
			var res Stats
			var err error
			var trace *wireTrace
			delta := kerneltest.StatDelta(t, func() {
				var tp ktlsTopology
				tp, trace = wearTopology(t, 16<<10)
				tun := New(tp.server, tp.relayB, Options{Pipes: pool})
				if tc.bothWays {
					res, err = exchangeThenClose(t, tp, tun, size)
					return
				}
				res, err = downstreamThrough(t, tp, tun, size)
			})
			t.Logf("gateway->upstream %+v; upstream->gateway %+v; tls_stat delta %v", res.AToB, res.BToA, delta)
			if err != nil {
				trace.explain(t)
				t.Fatal(err)
			}
			// 4 MiB is 256 full records: a TX key per splice (sealMargin
			// exceeds the limit) and, where the gateway sends as much,
			// several of its keys.
			wantRX := int64(2)
			if !tc.bothWays {
				wantRX = 0
			}
			if delta["TlsTxRekeyOk"] < 4 || delta["TlsRxRekeyOk"] < wantRX {
				t.Errorf("tls_stat %v: want at least 4 TX and %d RX renewals", delta, wantRX)
			}
			if delta["TlsDecryptError"] != 0 || delta["TlsTxRekeyError"] != 0 || delta["TlsRxRekeyError"] != 0 {
				t.Errorf("tls_stat %v: want no decrypt or rekey error", delta)
			}
		})
	}
}

// wearTopology is newKTLSTopology for TLS 1.3 with a record limit of 64, no
// KeyUpdate rate limit, and the kTLS socket's send buffer set to sndbuf. (A
// receive buffer that small at the gateway would make loopback TCP, whose
// segments are 64 KiB, wait for its persist timer: 200 ms a window.)
func wearTopology(t *testing.T, sndbuf int) (ktlsTopology, *wireTrace) {
	ca := testpki.NewCA(t, "splice key wear CA")
	cliRaw, srvRaw := tcpPair(t)
	trace := &wireTrace{Conn: cliRaw}
	if err := srvRaw.SetWriteBuffer(sndbuf); err != nil {
		t.Fatal(err)
	}
	server := ktls.Server(srvRaw, &tls.Config{Certificates: []tls.Certificate{ca.Server(t).TLS}},
		ktls.Options{RequireOffload: true, RecordLimit: 64, KeyUpdateLimit: ktls.Rate{PerSecond: 1e6, Burst: 1e6}})
	gateway := tls.Client(trace, &tls.Config{RootCAs: ca.Pool, ServerName: "localhost", MinVersion: tls.VersionTLS13, KeyLogWriter: trace.keyLogWriter()})
	tp := handshakeTopology(t, server, gateway)
	trace.suite = gateway.ConnectionState().CipherSuite
	return tp, trace
}

// exchangeThenClose runs the tunnel and streams size bytes each way at
// once, the gateway's and the upstream's streams independent; each end
// closes its side only once it has everything the other sent: the upstream
// first, then the gateway at its EOF. Go's crypto/tls peer needs both:
// while its Write is blocked it cannot answer a request to update (the
// answer waits for the write lock), which an echo would turn into a
// deadlock, and once it has sent close_notify it cannot answer at all and
// fails to open the records behind the request (ktls.Conn.peerEnded).
func exchangeThenClose(t *testing.T, tp ktlsTopology, tun *Relay, size int64) (Stats, error) {
	wait := runRelay(t.Context(), tun)
	var wg sync.WaitGroup
	var gwSent, upSent []byte
	var gwSendErr, upSendErr, upRecvErr, upCloseErr error
	upSum := sha256.New()
	var upRest []byte
	wg.Go(func() { gwSent, gwSendErr = sendStream(tp.gateway, 7, size) })
	wg.Go(func() {
		var wg2 sync.WaitGroup
		wg2.Go(func() { upSent, upSendErr = sendStream(tp.upstream, 8, size) })
		_, upRecvErr = io.CopyN(hashWriter{upSum}, tp.upstream, size)
		wg2.Wait()
		upCloseErr = tp.upstream.CloseWrite()
		upRest, _ = io.ReadAll(tp.upstream)
	})
	gwGot, gwSum, gwRecvErr := recvStream(tp.gateway)
	gwCloseErr := tp.gateway.CloseWrite()
	wg.Wait()
	res, relayErr := wait()
	if err := errors.Join(gwSendErr, upSendErr, upRecvErr, upCloseErr, gwRecvErr, gwCloseErr, relayErr); err != nil {
		return res, err
	}
	if gwGot != size || !bytes.Equal(gwSum, upSent) || !bytes.Equal(upSum.Sum(nil), gwSent) || len(upRest) != 0 {
		return res, fmt.Errorf("through kTLS: the gateway got %d bytes (digest equal %v), the upstream's digest equal %v, %d bytes past the stream",
			gwGot, bytes.Equal(gwSum, upSent), bytes.Equal(upSum.Sum(nil), gwSent), len(upRest))
	}
	return res, nil
}

// downstreamThrough runs the tunnel, closes the gateway's side at once
// (close_notify), sends size bytes from the upstream and checks what the
// gateway gets.
func downstreamThrough(t *testing.T, tp ktlsTopology, tun *Relay, size int64) (Stats, error) {
	wait := runRelay(t.Context(), tun)
	var sent []byte
	var sendErr error
	done := make(chan struct{})
	go func() {
		defer close(done)
		sent, sendErr = sendStream(tp.upstream, 11, size)
		if sendErr == nil {
			sendErr = tp.upstream.CloseWrite()
		}
	}()
	closeErr := tp.gateway.CloseWrite()
	got, gotSum, recvErr := recvStream(tp.gateway)
	<-done
	_, upErr := io.Copy(io.Discard, tp.upstream)
	res, relayErr := wait()
	if err := errors.Join(closeErr, sendErr, recvErr, upErr, relayErr); err != nil {
		return res, err
	}
	if got != size || !bytes.Equal(gotSum, sent) {
		return res, errors.New("upstream → gateway through kTLS: digest or size mismatch")
	}
	return res, nil
}
