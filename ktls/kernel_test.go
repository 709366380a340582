package ktls

import (
	"bufio"
	"bytes"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
)

// Tests named TestKernel… need kernel TLS: they SKIP on a host without it
// and FAIL in the VM harness (KTLS_REQUIRE=1). KTLS_TEST_MIB sets the bulk
// transfer each way (bulkSize): every connection of the matrices (Go and
// OpenSSL clients, RX in the kernel and in userspace) and of the data-path
// tests; default defaultBulkMiB, so the package runs in minutes under TCG
// emulation (a full-size run sets 64). Close, alert and KeyUpdate tests
// move fixed small amounts (smallBytes), whatever it says.

const (
	defaultBulkMiB = 1
	smallBytes     = 256 << 10
)

// statDelta is kerneltest.StatDelta after a first Probe, whose throwaway
// sockets would otherwise show up in the first delta.
func statDelta(t *testing.T, fn func()) kerneltest.Stat {
	t.Helper()
	Probe()
	return kerneltest.StatDelta(t, fn)
}

func wantStat(t *testing.T, d kerneltest.Stat, counter string, want int64) {
	t.Helper()
	if d[counter] != want {
		t.Errorf("tls_stat %s moved by %d, want %d (delta %v)", counter, d[counter], want, d)
	}
}

// TestKernelMatrix: the Go client's matrix (connCases: every suite of TLS
// 1.2 and 1.3; tickets on/off × resumed × client auth), both directions in
// the kernel, data checked by SHA-256, close_notify both ways, and tls_stat
// proving one TX and one RX install per connection.
func TestKernelMatrix(t *testing.T) {
	kerneltest.Require(t)
	checkNoFDLeak(t, kerneltest.OpenFDs)
	p := newTestPKI(t)
	n := bulkSize(t, defaultBulkMiB)
	for _, cc := range connCases {
		t.Run(cc.name, func(t *testing.T) {
			var pr *pair
			d := statDelta(t, func() { pr = runCase(t, p, cc, Options{}, n, ReasonNone) })
			wantStat(t, d, "TlsTxSw", cc.connections())
			wantStat(t, d, "TlsRxSw", cc.connections())
			wantStat(t, d, "TlsDecryptError", 0)
			if off := pr.server.Offload(); off.TX != ModeSW || off.RX != ModeSW {
				t.Errorf("modes TX %v RX %v, want sw/sw", off.TX, off.RX)
			}
		})
	}
}

// TestKernelDisableRX: the kernel seals, Go opens, over the whole Go
// client matrix and one OpenSSL shape (ChaCha20, client auth, resumed):
// the same bulk transfers, SHA-256 checked, and tls_stat shows a TX
// install per connection and no RX install.
func TestKernelDisableRX(t *testing.T) {
	kerneltest.Require(t)
	p := newTestPKI(t)
	n := bulkSize(t, defaultBulkMiB)
	opts := Options{DisableRX: true}
	for _, cc := range connCases {
		t.Run(cc.name, func(t *testing.T) {
			var pr *pair
			d := statDelta(t, func() { pr = runCase(t, p, cc, opts, n, ReasonRXDisabled) })
			wantStat(t, d, "TlsTxSw", cc.connections())
			wantStat(t, d, "TlsRxSw", 0)
			if off := pr.server.Offload(); off.TX != ModeSW || off.RX != ModeUserspace {
				t.Errorf("modes TX %v RX %v, want sw/userspace", off.TX, off.RX)
			}
			if _, ok := pr.server.SpliceSource(); ok {
				t.Error("SpliceSource ok with RX in userspace")
			}
		})
	}
	su, shape := opensslSuites[1], opensslShapes[1]
	t.Run("openssl-"+su.name+"/"+shape.String(), func(t *testing.T) {
		conns, d := runOpenSSLShape(t, p, su, shape, opts, n)
		wantStat(t, d, "TlsTxSw", conns)
		wantStat(t, d, "TlsRxSw", 0)
	})
}

// TestKernelExpectNoPad: TLS_RX_EXPECT_NO_PAD against a peer that does not
// pad. The kernel reports the option in effect with it (sock_diag), and not
// without it; the counters alone cannot tell the two apart.
func TestKernelExpectNoPad(t *testing.T) {
	kerneltest.Require(t)
	if !Probe().ExpectNoPad {
		t.Fatalf("kernel refuses TLS_RX_EXPECT_NO_PAD:\n%v", Probe())
	}
	p := newTestPKI(t)
	for _, on := range []bool{true, false} {
		var pr *pair
		d := statDelta(t, func() {
			pr = runCase(t, p, connCases[0], Options{ExpectNoPad: on}, bulkSize(t, defaultBulkMiB), ReasonNone)
		})
		if got := pr.server.Offload().RXNoPad; got != on {
			t.Errorf("ExpectNoPad %v: the kernel reports TLS_RX_EXPECT_NO_PAD in effect: %v", on, got)
		}
		wantStat(t, d, "TlsRxNoPadViolation", 0)
		wantStat(t, d, "TlsRxSw", 1)
	}
}

// opensslRun is one openssl s_client process and the Server connection it
// talks to.
type opensslRun struct {
	server *Conn
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stdout *bufio.Reader
	stderr bytes.Buffer
}

// startOpenSSL runs `openssl s_client args…` against a Server.
func startOpenSSL(t *testing.T, p *testPKI, scfg *tls.Config, opts Options, args ...string) *opensslRun {
	t.Helper()
	bin, err := exec.LookPath("openssl")
	if err != nil {
		t.Fatalf("openssl is needed for this test: %v", err)
	}
	dir := t.TempDir()
	caFile := p.ca.WriteFile(t, dir, "ca")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	r := &opensslRun{}
	all := append([]string{"s_client", "-connect", ln.Addr().String(), "-CAfile", caFile, "-servername", "localhost"}, args...)
	r.cmd = exec.Command(bin, all...)
	r.cmd.Stderr = &r.stderr
	if r.stdin, err = r.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	out, err := r.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	r.stdout = bufio.NewReader(out)
	if err := r.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		r.stdin.Close()
		r.cmd.Process.Kill()
		r.cmd.Wait()
	})
	raw, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	r.server = Server(raw, scfg, opts)
	t.Cleanup(func() { r.server.Close() })
	r.server.SetDeadline(time.Now().Add(3 * time.Minute))
	if err := r.server.Handshake(); err != nil {
		t.Fatalf("handshake with openssl: %v\n%s", err, r.stderr.String())
	}
	return r
}

// opensslShape is one handshake shape of the OpenSSL matrix. With resume,
// a full handshake saves the session and a second connection resumes it.
type opensslShape struct {
	tickets, mutualAuth, resume bool
}

func (s opensslShape) String() string {
	name := "no-tickets"
	if s.tickets {
		name = "tickets"
	}
	if s.mutualAuth {
		name += "-mtls"
	}
	if s.resume {
		name += "-then-resumed"
	}
	return name
}

// opensslShapes is tickets on/off × client auth × resumed (which needs a
// ticket: Go's server keeps no session-ID cache, for TLS 1.2 either; the
// full handshake before it covers the fresh one with tickets).
var opensslShapes = []opensslShape{
	{tickets: true, resume: true}, {tickets: true, mutualAuth: true, resume: true}, {}, {mutualAuth: true},
}

// opensslSuite is a suite of the OpenSSL matrix and the s_client
// arguments that force it.
type opensslSuite struct {
	name  string
	suite uint16
	args  []string
}

var opensslSuites = []opensslSuite{
	{"tls13-aes256", tls.TLS_AES_256_GCM_SHA384, []string{"-tls1_3", "-ciphersuites", "TLS_AES_256_GCM_SHA384"}},
	{"tls13-chacha20", tls.TLS_CHACHA20_POLY1305_SHA256, []string{"-tls1_3", "-ciphersuites", "TLS_CHACHA20_POLY1305_SHA256"}},
	{"tls13-aes128", tls.TLS_AES_128_GCM_SHA256, []string{"-tls1_3", "-ciphersuites", "TLS_AES_128_GCM_SHA256"}},
	{"tls12-aes256", tls.TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384, []string{"-tls1_2", "-cipher", "ECDHE-ECDSA-AES256-GCM-SHA384"}},
	{"tls12-aes128", tls.TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256, []string{"-tls1_2", "-cipher", "ECDHE-ECDSA-AES128-GCM-SHA256"}},
	{"tls12-chacha20", tls.TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256, []string{"-tls1_2", "-cipher", "ECDHE-ECDSA-CHACHA20-POLY1305"}},
}

// TestKernelOpenSSLSuites: a real OpenSSL client, each suite of both
// versions (TLS 1.3 AES-128/256-GCM and ChaCha20-Poly1305, TLS 1.2 ECDHE
// AES-128/256-GCM and ChaCha20-Poly1305) across tickets on/off × client
// auth × resumption (-sess_out/-sess_in). Every connection, the full
// handshake before a resumed one included, moves the bulk size each way.
func TestKernelOpenSSLSuites(t *testing.T) {
	kerneltest.Require(t)
	p := newTestPKI(t)
	n := bulkSize(t, defaultBulkMiB)
	for _, su := range opensslSuites {
		for _, shape := range opensslShapes {
			t.Run(su.name+"/"+shape.String(), func(t *testing.T) {
				conns, d := runOpenSSLShape(t, p, su, shape, Options{}, n)
				wantStat(t, d, "TlsTxSw", conns)
				wantStat(t, d, "TlsRxSw", conns)
				wantStat(t, d, "TlsDecryptError", 0)
			})
		}
	}
}

// runOpenSSLShape runs one shape with s_client: a full handshake, and with
// resume a second connection resuming its saved session; each moves n
// bytes both ways. It returns the connections made and the tls_stat delta.
func runOpenSSLShape(t *testing.T, p *testPKI, su opensslSuite, shape opensslShape, opts Options, n int) (int64, kerneltest.Stat) {
	t.Helper()
	scfg, _ := p.configs(connCase{tickets: shape.tickets, mutualAuth: shape.mutualAuth})
	args := append(slices.Clone(su.args), "-quiet")
	if shape.mutualAuth {
		certFile, keyFile := p.client.WriteFiles(t, t.TempDir(), "client")
		args = append(args, "-cert", certFile, "-key", keyFile)
	}
	conns := int64(1)
	d := statDelta(t, func() {
		if shape.resume {
			session := filepath.Join(t.TempDir(), "session.pem")
			first := startOpenSSL(t, p, scfg, opts, append(args, "-sess_out", session)...)
			first.check(t, su.suite, shape, false)
			first.exchange(t, n)
			if st, err := os.Stat(session); err != nil || st.Size() == 0 {
				t.Fatalf("openssl saved no session: %v\n%s", err, first.stderr.String())
			}
			args = append(args, "-sess_in", session)
			conns = 2
		}
		r := startOpenSSL(t, p, scfg, opts, args...)
		r.check(t, su.suite, shape, shape.resume)
		r.exchange(t, n)
	})
	return conns, d
}

// check verifies the server's view of an openssl handshake: offloaded as
// its options ask (TX and RX, or TX only) with the suite asked for, resumed
// or not, with or without a client certificate.
func (r *opensslRun) check(t *testing.T, suite uint16, shape opensslShape, resumed bool) {
	t.Helper()
	off := r.server.Offload()
	want, rx := ReasonNone, ModeSW
	if r.server.opts.DisableRX {
		want, rx = ReasonRXDisabled, ModeUserspace
	}
	if off.Reason != want || off.CipherSuite != suite || off.TX != ModeSW || off.RX != rx {
		t.Fatalf("Offload() = %+v, want %s with suite %s, TX sw, RX %v", off, want, tls.CipherSuiteName(suite), rx)
	}
	state := r.server.ConnectionState()
	if state.DidResume != resumed {
		t.Fatalf("server DidResume = %v, want %v", state.DidResume, resumed)
	}
	if got := len(state.PeerCertificates) > 0; got != shape.mutualAuth {
		t.Fatalf("client certificate seen %v, want %v", got, shape.mutualAuth)
	}
}

// exchange moves n bytes from openssl to the server and n back, checked by
// SHA-256, then closes with close_notify, after which openssl exits.
func (r *opensslRun) exchange(t *testing.T, n int) {
	t.Helper()
	// client → server: what openssl reads from stdin.
	go func() {
		io.Copy(r.stdin, payload(7, n))
	}()
	got, m, err := sum256(io.LimitReader(r.server, int64(n)))
	if want, _, _ := sum256(payload(7, n)); err != nil || m != int64(n) || got != want {
		t.Fatalf("openssl → server: %d bytes, %v, sha ok %v", m, err, got == want)
	}
	// server → client, then close_notify: openssl exits. Its stdout is
	// drained meanwhile, or it stops reading.
	type result struct {
		sum [32]byte
		n   int64
		err error
	}
	out := make(chan result, 1)
	go func() {
		s, m, err := sum256(r.stdout)
		out <- result{s, m, err}
	}()
	if _, err := io.Copy(r.server, payload(8, n)); err != nil {
		t.Fatal(err)
	}
	if err := r.server.Close(); err != nil {
		t.Fatal(err)
	}
	res := <-out
	if want, _, _ := sum256(payload(8, n)); res.err != nil || res.n != int64(n) || res.sum != want {
		t.Fatalf("server → openssl: %d bytes, %v, sha ok %v\n%s", res.n, res.err, res.sum == want, r.stderr.String())
	}
	// openssl writes the session file (-sess_out) before it exits.
	if err := r.cmd.Wait(); err != nil {
		t.Fatalf("openssl: %v\n%s", err, r.stderr.String())
	}
}

// hexLine returns a line of hex text: data that s_client never mistakes for
// one of its commands (which it reads from the first byte of a stdin chunk).
func hexLine(n int) []byte {
	b := make([]byte, n/2)
	rand.Read(b)
	return append([]byte(hex.EncodeToString(b)), '\n')
}

// sendAndExpect writes a line through openssl and reads it on the server.
func (r *opensslRun) sendAndExpect(t *testing.T, line []byte) error {
	t.Helper()
	if _, err := r.stdin.Write(line); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(line))
	if _, err := io.ReadFull(r.server, got); err != nil {
		return err
	}
	if !bytes.Equal(got, line) {
		t.Fatalf("server read %q, want %q", got, line)
	}
	return nil
}

// command sends an s_client command letter and gives it time to act.
func (r *opensslRun) command(t *testing.T, letter string) {
	if _, err := r.stdin.Write([]byte(letter + "\n")); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
}

// TestKernelKeyUpdate: the peer's KeyUpdate rekeys RX (and TX when it asks
// for an update) on kernels that can (>= 6.14); elsewhere the connection is
// closed with ErrRekeyUnsupported. With RX in userspace the opener rekeys
// on any kernel, so there only a requested update (a second TLS_TX)
// closes it.
func TestKernelKeyUpdate(t *testing.T) {
	kerneltest.Require(t)
	p := newTestPKI(t)
	scfg, _ := p.configs(connCase{})
	for _, tc := range []struct {
		name     string
		opts     Options
		rxRekeys int64 // TLS_RX installs by the two KeyUpdates (tls_stat)
	}{
		{"rx-kernel", Options{}, 2},
		{"rx-off", Options{DisableRX: true}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := startOpenSSL(t, p, scfg, tc.opts, "-tls1_3", "-brief")
			if err := r.sendAndExpect(t, hexLine(2000)); err != nil {
				t.Fatal(err)
			}
			before := Stats().KeyUpdates
			var notRequested, requested error
			d := statDelta(t, func() {
				r.command(t, "k") // KeyUpdate, update_not_requested
				if notRequested = r.sendAndExpect(t, hexLine(2000)); notRequested != nil {
					return
				}
				r.command(t, "K") // update_requested: we answer and move TX
				if requested = r.sendAndExpect(t, hexLine(2000)); requested != nil {
					return
				}
				// Data from us under the new TX key must reach openssl.
				line := hexLine(100)
				if _, err := r.server.Write(line); err != nil {
					t.Fatal(err)
				}
				got, err := r.stdout.ReadBytes('\n')
				if err != nil || !bytes.Equal(got, line) {
					t.Fatalf("openssl read %q (%v) after our KeyUpdate, want %q\n%s", got, err, line, r.stderr.String())
				}
			})
			applied := Stats().KeyUpdates - before
			switch {
			case Probe().Rekey:
				if notRequested != nil || requested != nil || applied != 2 {
					t.Fatalf("after KeyUpdates: %v, %v; %d applied, want both, no error\n%s", notRequested, requested, applied, r.stderr.String())
				}
				wantStat(t, d, "TlsRxRekeyOk", tc.rxRekeys)
				wantStat(t, d, "TlsTxRekeyOk", 1)
				return
			case tc.opts.DisableRX:
				if notRequested != nil || !errors.Is(requested, ErrRekeyUnsupported) || applied != 1 {
					t.Fatalf("without kernel rekey, RX in userspace: %v, then %v; %d applied; "+
						"want the first applied by the opener, ErrRekeyUnsupported at the requested one", notRequested, requested, applied)
				}
				wantStat(t, d, "TlsRxRekeyOk", 0)
				wantStat(t, d, "TlsTxRekeyOk", 0)
			default:
				if !errors.Is(notRequested, ErrRekeyUnsupported) || applied != 0 {
					t.Fatalf("Read after KeyUpdate on a kernel without rekey: %v, %d applied; want ErrRekeyUnsupported", notRequested, applied)
				}
			}
			if _, err := r.server.Write([]byte("x")); err == nil {
				t.Fatal("connection still writable after the clean close")
			}
		})
	}
}

// kernelPeers connects a Client to a Server over loopback TCP, completes
// both handshakes and requires both to run fully in the kernel.
func kernelPeers(t testing.TB, scfg, ccfg *tls.Config, sopts Options) (server, client *Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	raw, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	srvRaw, err := ln.Accept()
	if err != nil {
		raw.Close()
		t.Fatal(err)
	}
	server, client = Server(srvRaw, scfg, sopts), Client(raw, ccfg, Options{})
	server.SetDeadline(time.Now().Add(time.Minute))
	client.SetDeadline(time.Now().Add(time.Minute))
	handshakeBoth(t, server, client)
	for _, c := range []*Conn{server, client} {
		if off := c.Offload(); off.Reason != ReasonNone {
			t.Fatalf("Offload() = %+v, want both directions in the kernel", off)
		}
	}
	return server, client
}

// handshakeBoth completes the handshakes of server and client, one
// connection's two ends, and closes both at the test's end.
func handshakeBoth(t testing.TB, server *Conn, client interface {
	Handshake() error
	Close() error
}) {
	t.Helper()
	t.Cleanup(func() { client.Close(); server.Close() })
	errc := make(chan error, 1)
	go func() { errc <- client.Handshake() }()
	if err := server.Handshake(); err != nil {
		t.Fatalf("server handshake: %v", err)
	}
	if err := <-errc; err != nil {
		t.Fatalf("client handshake: %v", err)
	}
}

// TestKernelKeyUpdateFlood: a peer that sends KeyUpdates back to back (a
// ktls Client rekeying its TX without pause) against the default limit is
// disconnected once the burst is spent, with ErrKeyUpdateRateLimited, and
// every KeyUpdate accepted until then was a real kernel rekey (tls_stat).
// Without kernel rekey (< 6.14) the first KeyUpdate closes the connection
// with ErrRekeyUnsupported, before any limit.
func TestKernelKeyUpdateFlood(t *testing.T) {
	kerneltest.Require(t)
	p := newTestPKI(t)
	scfg, ccfg := p.configs(connCase{version: tls.VersionTLS13})
	var events []EventKind
	opts := Options{Observer: func(e Event) { events = append(events, e.Kind) }}
	server, client := kernelPeers(t, scfg, ccfg, opts)
	if _, err := client.Write([]byte("before")); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 6)
	if _, err := io.ReadFull(server, b); err != nil || string(b) != "before" {
		t.Fatalf("server read %q (%v) before the flood", b, err)
	}
	// At the default 10/s refill, the limit stays unreached only if the
	// server took more than 18 s for these.
	const flood = 200
	before := Stats()
	var rekeyed int
	var readErr error
	d := statDelta(t, func() {
		done := make(chan struct{})
		go func() {
			defer close(done)
			// Each updateTX sends a KeyUpdate under the current key, then
			// installs the next TX key; it fails once the server is gone
			// (or, before 6.14, at the first install).
			for rekeyed < flood && client.updateTX(false) == nil {
				rekeyed++
			}
		}()
		_, readErr = io.Copy(io.Discard, server)
		<-done
	})
	accepted := Stats().KeyUpdates - before.KeyUpdates
	limited := Stats().RateLimitedClose - before.RateLimitedClose
	countEvents := func(k EventKind) int {
		return len(slices.DeleteFunc(slices.Clone(events), func(e EventKind) bool { return e != k }))
	}
	if !Probe().Rekey {
		if !errors.Is(readErr, ErrRekeyUnsupported) || accepted != 0 || limited != 0 || rekeyed != 0 || countEvents(EventRekeyUnsupported) != 1 {
			t.Fatalf("without kernel rekey: Read %v, %d KeyUpdates applied, %d rate-limited closes, client rekeyed %d, events %v; "+
				"want ErrRekeyUnsupported at the first, 0, 0, 0, one rekey-unsupported event", readErr, accepted, limited, rekeyed, events)
		}
	} else {
		burst := uint64(DefaultKeyUpdateLimit.Burst)
		if !errors.Is(readErr, ErrKeyUpdateRateLimited) || limited != 1 || accepted < burst || accepted >= flood {
			t.Fatalf("flood of %d: Read %v, %d applied, %d rate-limited closes; want ErrKeyUpdateRateLimited after %d to %d applied, 1 close",
				flood, readErr, accepted, limited, burst, flood-1)
		}
		// The server's RX rekeys are the KeyUpdates it applied; the TX
		// rekeys are the client's (tls_stat counts the whole namespace).
		wantStat(t, d, "TlsRxRekeyOk", int64(accepted))
		wantStat(t, d, "TlsTxRekeyOk", int64(rekeyed))
		wantStat(t, d, "TlsRxRekeyError", 0)
		wantStat(t, d, "TlsTxRekeyError", 0)
		if uint64(rekeyed) < accepted || countEvents(EventKeyUpdate) != int(accepted) || countEvents(EventRateLimited) != 1 || countEvents(EventRekeyUnsupported) != 0 {
			t.Fatalf("client rekeyed %d times, events %v: want at least the %d applied, that many key-update events and one rate-limited", rekeyed, events, accepted)
		}
		t.Logf("flood: %d KeyUpdates applied, then the rate-limited close (client rekeyed %d times)", accepted, rekeyed)
	}
	if _, err := server.Write([]byte("x")); err == nil {
		t.Fatal("server connection still writable after the clean close")
	}
}

// TestKernelPeerAlert: a fatal alert from the peer is an error naming it,
// and Client works with both directions in the kernel.
func TestKernelPeerAlert(t *testing.T) {
	kerneltest.Require(t)
	p := newTestPKI(t)
	scfg, ccfg := p.configs(connCase{version: tls.VersionTLS13})
	s, c := kernelPeers(t, scfg, ccfg, Options{})
	go func() {
		c.Write([]byte("hello"))
		c.writeMu.Lock()
		c.sendControlLocked(recordAlert, []byte{2, 40}) // fatal handshake_failure
		c.writeMu.Unlock()
		io.Copy(io.Discard, c)
	}()
	buf := make([]byte, 5)
	if _, err := io.ReadFull(s, buf); err != nil || string(buf) != "hello" {
		t.Fatalf("read %q, %v", buf, err)
	}
	_, err := s.Read(buf)
	var alert AlertError
	if !errors.As(err, &alert) || alert != 40 || !strings.Contains(err.Error(), "handshake_failure") {
		t.Fatalf("Read after a fatal alert: %v, want AlertError handshake_failure", err)
	}
}

// TestKernelGarbageRecord: a record that does not decrypt gives a clean
// error (the kernel reports EBADMSG), not a panic or a hang.
func TestKernelGarbageRecord(t *testing.T) {
	kerneltest.Require(t)
	pr := tls13Pair(t)
	defer pr.close()
	garbage := append([]byte{23, 3, 3, 0, 64}, bytes.Repeat([]byte{0x5a}, 64)...)
	var rerr error
	d := statDelta(t, func() {
		pr.held.Conn.Write(garbage)
		pr.server.SetReadDeadline(time.Now().Add(time.Minute))
		_, rerr = pr.server.Read(make([]byte, 10))
	})
	if rerr == nil || isTimeout(rerr) {
		t.Fatalf("Read of a garbage record: %v, want a decryption error", rerr)
	}
	wantStat(t, d, "TlsDecryptError", 1)
}

// TestKernelReadFromWriteTo: sendfile from a file under two LimitedReaders
// into the kTLS socket, and splice from the kTLS socket into a TCP upstream
// across the peer's close_notify.
func TestKernelReadFromWriteTo(t *testing.T) {
	kerneltest.Require(t)
	p := newTestPKI(t)
	n := bulkSize(t, defaultBulkMiB)
	scfg, ccfg := p.configs(connCase{version: tls.VersionTLS13})
	pr, err := dialPair(t, scfg, ccfg, Options{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer pr.close()
	readFromFile(t, pr, 9, n)
	// WriteTo a TCP upstream: Go splices socket to socket.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	sums := make(chan [32]byte, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			sums <- [32]byte{}
			return
		}
		defer c.Close()
		s, _, _ := sum256(c)
		sums <- s
	}()
	up, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		io.Copy(pr.client, payload(10, n))
		pr.client.CloseWrite()
	}()
	w, err := pr.server.WriteTo(up)
	if err != nil || w != int64(n) {
		t.Fatalf("WriteTo: %d, %v; want %d", w, err, n)
	}
	up.Close()
	if want, _, _ := sum256(payload(10, n)); <-sums != want {
		t.Fatal("WriteTo: upstream bytes differ")
	}
}

// readFromFile sends n bytes of payload(seed) from a file, under two nested
// LimitedReaders as Caddy's file server wraps it, through pr.server.ReadFrom
// (sendfile into the kTLS socket), and checks what the client reads.
func readFromFile(t *testing.T, pr *pair, seed uint64, n int) {
	t.Helper()
	src, err := os.Create(filepath.Join(t.TempDir(), "src"))
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	if _, err := io.Copy(src, payload(seed, n+1000)); err != nil {
		t.Fatal(err)
	}
	src.Seek(0, io.SeekStart)
	done := make(chan error, 1)
	go func() {
		_, err := pr.server.ReadFrom(&io.LimitedReader{R: &io.LimitedReader{R: src, N: int64(n + 500)}, N: int64(n)})
		done <- err
	}()
	got, m, err := sum256(io.LimitReader(pr.client, int64(n)))
	if want, _, _ := sum256(payload(seed, n)); err != nil || m != int64(n) || got != want {
		t.Fatalf("ReadFrom: client got %d bytes, %v, sha ok %v", m, err, got == want)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestKernelClient: Client with both directions in the kernel drops the
// server's NewSessionTicket (a handshake record on kTLS RX).
func TestKernelClient(t *testing.T) {
	kerneltest.Require(t)
	p := newTestPKI(t)
	before := Stats().ControlRecords["handshake"]
	var c *Conn
	d := statDelta(t, func() { c = runClient(t, p, tls.VersionTLS13, bulkSize(t, defaultBulkMiB), 1)[0] })
	wantStat(t, d, "TlsTxSw", 1)
	wantStat(t, d, "TlsRxSw", 1)
	if c.Offload().Reason != ReasonNone {
		t.Fatalf("client reason %q, want none", c.Offload().Reason)
	}
	if got := Stats().ControlRecords["handshake"] - before; got < 1 {
		t.Fatalf("no NewSessionTicket record went through Read (handshake records %d)", got)
	}
}

// TestKernelClientResumption is TestClientResumption on a kTLS kernel,
// with tls_stat proving which connections ran in the kernel.
func TestKernelClientResumption(t *testing.T) {
	kerneltest.Require(t)
	p := newTestPKI(t)
	for _, version := range []uint16{tls.VersionTLS13, tls.VersionTLS12} {
		t.Run(tls.VersionName(version), func(t *testing.T) {
			var offloaded int64
			d := statDelta(t, func() { offloaded = clientResumption(t, p, version) })
			if want := map[uint16]int64{tls.VersionTLS13: 2, tls.VersionTLS12: 1}[version]; offloaded != want {
				t.Fatalf("%d connections fully offloaded, want %d", offloaded, want)
			}
			wantStat(t, d, "TlsTxSw", offloaded)
			wantStat(t, d, "TlsRxSw", offloaded)
		})
	}
}

// TestKernelCloseNotifyOnTheWire: after the server's Close or CloseWrite
// the peer receives a real close_notify record sealed by the kernel, not
// only a FIN (crypto/tls reads a FIN at a record boundary as io.EOF too, so
// the client's EOF alone proves nothing). The client's raw bytes after the
// handshake are recorded and opened with the server's TX keys: the
// application data, then one alert record 01 00, then the end of the
// stream. After CloseWrite the server still reads what the client sends.
func TestKernelCloseNotifyOnTheWire(t *testing.T) {
	kerneltest.Require(t)
	p := newTestPKI(t)
	n := smallBytes
	for _, tc := range []struct {
		name       string
		version    uint16
		closeWrite bool
	}{
		{"tls13-close", tls.VersionTLS13, false},
		{"tls13-closewrite", tls.VersionTLS13, true},
		{"tls12-close", tls.VersionTLS12, false},
		{"tls12-closewrite", tls.VersionTLS12, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// No tickets: nothing from the server is in flight when the
			// handshake ends, so every byte the client reads from here on is
			// sealed under the server's application key, from tx.seq on.
			scfg, ccfg := p.configs(connCase{version: tc.version})
			pr, err := dialPair(t, scfg, ccfg, Options{}, nil)
			if err != nil {
				t.Fatal(err)
			}
			if off := pr.server.Offload(); off.Reason != ReasonNone {
				t.Fatalf("Offload() = %+v, want both directions in the kernel", off)
			}
			rec := &recordingConn{Conn: pr.held.Conn}
			pr.held.Conn = rec
			state := pr.server.ConnectionState()
			tx, _, err := pr.server.directionKeys(state)
			if err != nil {
				t.Fatal(err)
			}
			pr.client.SetDeadline(time.Now().Add(time.Minute))
			pr.server.SetReadDeadline(time.Now().Add(time.Minute))
			closeServer := pr.server.Close
			if tc.closeWrite {
				closeServer = pr.server.CloseWrite
			}
			streamAndCheck(t, "server → client", pr.server, closeServer, pr.client, 11, n)
			opener, err := newRecordOpener(state.Version, state.CipherSuite, tx.key, tx.iv, tx.seq)
			if err != nil {
				t.Fatal(err)
			}
			rec.mu.Lock()
			wire := bytes.Clone(rec.in.Bytes())
			rec.mu.Unlock()
			appData, types, alert := openAll(t, opener, splitRecords(t, wire))
			want, _, _ := sum256(payload(11, n))
			if sum, _, _ := sum256(bytes.NewReader(appData)); sum != want || len(appData) != n {
				t.Fatalf("opened %d bytes of application data, want the %d sent", len(appData), n)
			}
			if last := len(types) - 1; types[last] != recordAlert || slices.Index(types, recordAlert) != last || !bytes.Equal(alert, closeNotify) {
				t.Fatalf("record types %v, last alert %x: want data records, then one close_notify (01 00) last", types, alert)
			}
			t.Logf("%s: %d records after the handshake, the last a close_notify sealed by the kernel", tls.VersionName(state.Version), len(types))
			if tc.closeWrite {
				streamAndCheck(t, "client → server after the server's CloseWrite", pr.client, pr.client.CloseWrite, pr.server, 12, n)
			}
		})
	}
}

// streamAndCheck writes payload(seed, n) into w and then calls finish, in
// a goroutine, while it reads r to its end: r must yield exactly those n
// bytes, and the writer must succeed.
func streamAndCheck(t *testing.T, what string, w io.Writer, finish func() error, r io.Reader, seed uint64, n int) {
	t.Helper()
	sent := make(chan error, 1)
	go func() {
		_, err := io.Copy(w, payload(seed, n))
		sent <- errors.Join(err, finish())
	}()
	got, m, err := sum256(r)
	if want, _, _ := sum256(payload(seed, n)); err != nil || m != int64(n) || got != want {
		t.Fatalf("%s: read %d bytes, %v, sha ok %v; want %d bytes, then the end", what, m, err, got == want, n)
	}
	if err := <-sent; err != nil {
		t.Fatalf("%s: writer: %v", what, err)
	}
}

// TestKernelWriteAfterPeerCloseNotify: the peer's close_notify ends our
// reads with io.EOF (every Read after it too), and our write side keeps
// working until we close: in this order, not concurrently.
func TestKernelWriteAfterPeerCloseNotify(t *testing.T) {
	kerneltest.Require(t)
	p := newTestPKI(t)
	n := smallBytes
	for _, tc := range []struct {
		name    string
		version uint16
		opts    Options
		reason  Reason
	}{
		{"tls13", tls.VersionTLS13, Options{}, ReasonNone},
		{"tls13-rx-off", tls.VersionTLS13, Options{DisableRX: true}, ReasonRXDisabled},
		{"tls12", tls.VersionTLS12, Options{}, ReasonNone},
	} {
		t.Run(tc.name, func(t *testing.T) {
			scfg, ccfg := p.configs(connCase{version: tc.version, tickets: true})
			pr, err := dialPair(t, scfg, ccfg, tc.opts, nil)
			if err != nil {
				t.Fatal(err)
			}
			if off := pr.server.Offload(); off.Reason != tc.reason || off.TX != ModeSW {
				t.Fatalf("Offload() = %+v, want reason %q with TX in the kernel", off, tc.reason)
			}
			pr.server.SetDeadline(time.Now().Add(time.Minute))
			pr.client.SetDeadline(time.Now().Add(time.Minute))
			streamAndCheck(t, "client → server until close_notify", pr.client, pr.client.CloseWrite, pr.server, 13, n)
			if k, err := pr.server.Read(make([]byte, 10)); k != 0 || err != io.EOF {
				t.Fatalf("Read after close_notify: %d, %v; want 0, io.EOF again", k, err)
			}
			// The client has closed its write side only: it still reads.
			streamAndCheck(t, "server → client after the peer's close_notify", pr.server, pr.server.Close, pr.client, 14, n)
		})
	}
}
