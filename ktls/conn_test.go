package ktls

import (
	"bytes"
	"cmp"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/cputest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
)

// expectedReason is what a fully offloadable connection reports on this
// kernel: none where kTLS works, no-kernel-support elsewhere.
func expectedReason() Reason {
	if Probe().ULP != nil {
		return ReasonNoKernelSupport
	}
	return ReasonNone
}

// runCase handshakes cc (twice when it resumes), checks the offload
// outcome, moves n bytes each way and checks close_notify both ways.
func runCase(t *testing.T, p *testPKI, cc connCase, opts Options, n int, want Reason) *pair {
	t.Helper()
	scfg, ccfg := p.configs(cc)
	if cc.suite != 0 && cc.version == tls.VersionTLS13 {
		onlyTLS13Suite(t, cc.suite)
	}
	if cc.resume {
		first, err := dialPair(t, scfg, ccfg, opts, nil)
		if err != nil {
			t.Fatalf("first handshake: %v", err)
		}
		// A TLS 1.3 ticket arrives after the handshake: the client sees
		// it while reading.
		exchange(t, first, 1024)
		first.close()
	}
	pr, err := dialPair(t, scfg, ccfg, opts, nil)
	if err != nil {
		t.Fatalf("handshake: %v", err)
	}
	if got := pr.client.ConnectionState().DidResume; got != cc.resume {
		t.Fatalf("client DidResume = %v, want %v", got, cc.resume)
	}
	if got := pr.server.ConnectionState().DidResume; got != cc.resume {
		t.Fatalf("server DidResume = %v, want %v", got, cc.resume)
	}
	off := pr.server.Offload()
	wantSuite := cc.suite
	if wantSuite == 0 {
		wantSuite = map[uint16]uint16{tls.VersionTLS13: tls.TLS_AES_128_GCM_SHA256, tls.VersionTLS12: tls.TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256}[cc.version]
	}
	if off.Reason != want || off.Version != cc.version || off.CipherSuite != wantSuite {
		t.Fatalf("Offload() = %+v, want reason %q version %#x suite %s", off, want, cc.version, tls.CipherSuiteName(wantSuite))
	}
	if cc.mutualAuth && len(pr.server.ConnectionState().PeerCertificates) == 0 {
		t.Fatal("server saw no client certificate")
	}
	// With both directions in the kernel the server keeps no tls.Conn, and
	// ConnectionState answers from what the handshake agreed: the same
	// session as the client's, down to its exported keying material.
	full := off.TX != ModeUserspace && off.RX != ModeUserspace
	if dropped := pr.server.tlsConn.Load() == nil; dropped != full {
		t.Errorf("tls.Conn dropped: %v, want %v (modes TX %v RX %v)", dropped, full, off.TX, off.RX)
	}
	ss, cs := pr.server.ConnectionState(), pr.client.ConnectionState()
	if !ss.HandshakeComplete || ss.Version != cs.Version || ss.CipherSuite != cs.CipherSuite || ss.ServerName != cs.ServerName ||
		ss.NegotiatedProtocol != cs.NegotiatedProtocol || ss.DidResume != cs.DidResume {
		t.Errorf("server ConnectionState %+v, client's %+v", ss, cs)
	}
	if cc.version == tls.VersionTLS13 {
		se, serr := ss.ExportKeyingMaterial("EXPORTER-test", nil, 32)
		ce, cerr := cs.ExportKeyingMaterial("EXPORTER-test", nil, 32)
		if serr != nil || cerr != nil || !bytes.Equal(se, ce) {
			t.Errorf("exported keying material: server %x (%v), client %x (%v)", se, serr, ce, cerr)
		}
	}
	exchange(t, pr, n)
	pr.close()
	return pr
}

// TestFallbackMatrix runs every handshake shape through the engine. On a
// kernel without kTLS every connection falls back with no-kernel-support
// and must still move data intact.
func TestFallbackMatrix(t *testing.T) {
	checkNoFDLeak(t, kerneltest.OpenFDs)
	p := newTestPKI(t)
	for _, cc := range connCases {
		t.Run(cc.name, func(t *testing.T) {
			pr := runCase(t, p, cc, Options{}, 1<<20, expectedReason())
			if want := expectedReason(); want == ReasonNoKernelSupport {
				off := pr.server.Offload()
				if off.TX != ModeUserspace || off.RX != ModeUserspace {
					t.Fatalf("fallback modes %v/%v, want userspace", off.TX, off.RX)
				}
				if _, ok := pr.server.SpliceSink(); ok {
					t.Fatal("SpliceSink ok on a fallback connection")
				}
			}
		})
	}
}

// TestFallbackReasons checks the reasons decided before the kernel is
// asked, on any kernel: each connection stays in userspace TLS, moves its
// data intact and is counted under its reason.
func TestFallbackReasons(t *testing.T) {
	p := newTestPKI(t)
	for _, tc := range []struct {
		desc    string
		cc      connCase
		network string // "tcp" unless set
		tweak   func(scfg, ccfg *tls.Config)
		wrap    func(net.Conn) net.Conn
		opts    Options
		want    Reason
	}{
		{
			desc: "offload switched off", cc: connCase{name: "disabled", version: tls.VersionTLS13},
			opts: Options{Disable: true},
			want: ReasonDisabled,
		},
		{
			desc: "CBC suite", cc: connCase{name: "cbc", version: tls.VersionTLS12},
			tweak: func(_, ccfg *tls.Config) {
				ccfg.CipherSuites = []uint16{tls.TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA}
			},
			want: ReasonCipher,
		},
		{
			desc: "TLS 1.1", cc: connCase{name: "tls11", version: tls.VersionTLS11},
			tweak: func(scfg, _ *tls.Config) { scfg.MinVersion = tls.VersionTLS10 },
			want:  ReasonVersion,
		},
		{
			desc: "hidden TCP conn", cc: connCase{name: "not-tcp", version: tls.VersionTLS13},
			wrap: func(c net.Conn) net.Conn { return struct{ net.Conn }{c} },
			want: ReasonNotTCP,
		},
		{
			desc: "unix socket", cc: connCase{name: "not-tcp-unix", version: tls.VersionTLS13},
			network: "unix",
			want:    ReasonNotTCP,
		},
		{
			desc: "layer still buffering", cc: connCase{name: "buffered-bytes", version: tls.VersionTLS12},
			wrap: layer(errLayerBuffered),
			want: ReasonBufferedBytes,
		},
	} {
		t.Run(tc.cc.name, func(t *testing.T) {
			scfg, ccfg := p.configs(tc.cc)
			if tc.tweak != nil {
				tc.tweak(scfg, ccfg)
			}
			before := Stats().Outcomes[tc.want]
			pr, err := dialPairOn(t, cmp.Or(tc.network, "tcp"), scfg, ccfg, tc.opts, tc.wrap)
			if err != nil {
				t.Fatal(err)
			}
			if off := pr.server.Offload(); off.Reason != tc.want || off.TX != ModeUserspace || off.RX != ModeUserspace {
				t.Errorf("%s: Offload() = %+v, want reason %q, both directions in userspace", tc.desc, off, tc.want)
			}
			if got := Stats().Outcomes[tc.want] - before; got != 1 {
				t.Errorf("%s: Stats().Outcomes[%s] grew by %d, want 1", tc.desc, tc.want, got)
			}
			exchange(t, pr, 64<<10)
			pr.close()
		})
	}
}

// TestRequireOffload: no fallback allowed, so the handshake fails naming
// the reason, and the observer and counters see it: the handshake's outcome,
// then the refusal.
func TestRequireOffload(t *testing.T) {
	p := newTestPKI(t)
	cc := connCase{name: "cbc", version: tls.VersionTLS12}
	scfg, ccfg := p.configs(cc)
	ccfg.CipherSuites = []uint16{tls.TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA}
	var rec eventRecorder
	opts := Options{RequireOffload: true, Observer: rec.observe}
	before := Stats()
	_, err := dialPair(t, scfg, ccfg, opts, nil)
	var oe *OffloadError
	if !errors.As(err, &oe) || oe.Reason != ReasonCipher || !strings.Contains(err.Error(), "cipher") {
		t.Fatalf("handshake error %v, want an OffloadError naming %q", err, ReasonCipher)
	}
	events := rec.seen()
	if len(events) != 2 || events[0].Kind != EventHandshake || events[0].Offload.Reason != ReasonCipher || events[0].Remote == nil ||
		events[1].Kind != EventRefused || !errors.As(events[1].Err, &oe) || oe.Reason != ReasonCipher {
		t.Fatalf("observer events %+v, want a handshake event with reason cipher, then a refused one with its OffloadError", events)
	}
	// The handshake event says how long the handshake and offload took;
	// the refusal is no handshake and has no duration.
	if events[0].Duration <= 0 || events[1].Duration != 0 {
		t.Errorf("durations: handshake %v, refused %v; want > 0 and 0", events[0].Duration, events[1].Duration)
	}
	if d := Stats().Outcomes[ReasonCipher] - before.Outcomes[ReasonCipher]; d != 1 {
		t.Fatalf("Stats().Outcomes[cipher] grew by %d, want 1", d)
	}
}

// TestHandshakeFailed: a client that rejects the certificate makes the
// server's handshake fail, with reason handshake-failed.
func TestHandshakeFailed(t *testing.T) {
	p := newTestPKI(t)
	scfg, ccfg := p.configs(connCase{version: tls.VersionTLS13})
	ccfg.RootCAs = nil // the test CA is unknown to the client
	var got []Event
	_, err := dialPair(t, scfg, ccfg, Options{Observer: func(e Event) { got = append(got, e) }}, nil)
	if err == nil {
		t.Fatal("handshake succeeded with an untrusted certificate")
	}
	if len(got) != 1 || got[0].Offload.Reason != ReasonHandshakeFailed || got[0].Err == nil {
		t.Fatalf("events %+v, want one handshake-failed", got)
	}
	if got[0].Duration <= 0 {
		t.Errorf("failed handshake's Duration %v, want > 0 (failures are timed too)", got[0].Duration)
	}
}

// TestGetConfigForClient: the config GetConfigForClient returns is the one
// whose certificate is served, and it is never modified.
func TestGetConfigForClient(t *testing.T) {
	p := newTestPKI(t)
	// A client with a session cache asks for tickets (psk_dhe_ke).
	scfg, ccfg := p.configs(connCase{version: tls.VersionTLS13, tickets: true, resume: true})
	chosen := scfg.Clone()
	base := &tls.Config{GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) { return chosen, nil }}
	pr, err := dialPair(t, base, ccfg, Options{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if chosen.KeyLogWriter != nil || chosen.WrapSession != nil || base.KeyLogWriter != nil {
		t.Fatal("caller's configs were modified")
	}
	if got := pr.server.Offload().Reason; got != expectedReason() {
		t.Fatalf("reason %q, want %q", got, expectedReason())
	}
	if len(pr.server.keys.get("SERVER_TRAFFIC_SECRET_0")) != 32 || pr.server.keys.tickets() != 1 {
		t.Fatalf("keys not captured through GetConfigForClient (tickets %d)", pr.server.keys.tickets())
	}
	exchange(t, pr, 64<<10)
	pr.close()
}

// TestClientFallback runs Client against a crypto/tls server.
func TestClientFallback(t *testing.T) {
	checkNoFDLeak(t, kerneltest.OpenFDs)
	c := runClient(t, newTestPKI(t), tls.VersionTLS13, 256<<10, 1)[0]
	if c.Offload().Reason != expectedReason() {
		t.Fatalf("client reason %q, want %q", c.Offload().Reason, expectedReason())
	}
}

// TestClientResumption pins what Client documents: a TLS 1.3 client's
// tickets reach its session cache whether reads run in the kernel or in
// crypto/tls, so the next connection resumes, and is offloaded like the
// first; a TLS 1.2 client keeps the session from the handshake and
// resumes, but crypto/tls logs no master secret for a resumed TLS 1.2
// client, so that connection stays in userspace TLS with reason
// key-capture, on any kernel, and still moves the data.
func TestClientResumption(t *testing.T) {
	p := newTestPKI(t)
	for _, version := range []uint16{tls.VersionTLS13, tls.VersionTLS12} {
		t.Run(tls.VersionName(version), func(t *testing.T) { clientResumption(t, p, version) })
	}
}

// clientResumption makes two Client connections of version, checks their
// outcomes and returns how many ran in the kernel (both directions).
func clientResumption(t *testing.T, p *testPKI, version uint16) (offloaded int64) {
	t.Helper()
	kept := Stats().TicketsKept
	conns := runClient(t, p, version, 64<<10, 2)
	first, second := conns[0], conns[1]
	if first.ConnectionState().DidResume || first.Offload().Reason != expectedReason() {
		t.Fatalf("first connection: resumed %v, reason %q; want a full handshake, reason %q",
			first.ConnectionState().DidResume, first.Offload().Reason, expectedReason())
	}
	if got := Stats().TicketsKept - kept; version == tls.VersionTLS13 && first.Offload().RX != ModeUserspace && got < 2 {
		t.Errorf("%d tickets passed from kernel RX to the session cache, want one per connection", got)
	}
	resumes, want := true, expectedReason()
	if version == tls.VersionTLS12 {
		want = ReasonKeyCapture
	}
	off := second.Offload()
	if second.ConnectionState().DidResume != resumes || off.Reason != want ||
		want == ReasonKeyCapture && (off.TX != ModeUserspace || off.RX != ModeUserspace) {
		t.Fatalf("second connection: resumed %v, %+v; want resumed %v, reason %q",
			second.ConnectionState().DidResume, off, resumes, want)
	}
	for _, c := range conns {
		if c.Offload().Reason == ReasonNone {
			offloaded++
		}
	}
	return offloaded
}

// runClient makes conns connections, one after the other, from Client to
// one crypto/tls server, with client auth, tickets and a client session
// cache, and reads n bytes and close_notify on each. With RX in the kernel
// a TLS 1.3 ticket arrives as a handshake record that Read passes on to the
// session cache.
func runClient(t *testing.T, p *testPKI, version uint16, n, conns int) []*Conn {
	scfg, ccfg := p.configs(connCase{version: version, tickets: true, mutualAuth: true, resume: true})
	ln, err := tls.Listen("tcp", "127.0.0.1:0", scfg)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	want, _, _ := sum256(payload(3, n))
	srvErr := make(chan error, 1)
	go func() {
		for range conns {
			c, err := ln.Accept()
			if err != nil {
				srvErr <- err
				return
			}
			if _, err := io.Copy(c, payload(3, n)); err != nil {
				c.Close()
				srvErr <- err
				return
			}
			// Wait for the client's close_notify before the FIN: a TLS 1.2
			// server finishes its handshake first, and a FIN that arrives
			// before the client installs kTLS makes TCP_ULP fail, since the
			// socket is no longer ESTABLISHED (docs/kernel/behaviour.md).
			err = c.(*tls.Conn).CloseWrite()
			if err == nil {
				_, err = io.Copy(io.Discard, c)
			}
			c.Close()
			if err != nil {
				srvErr <- err
				return
			}
		}
		srvErr <- nil
	}()
	var out []*Conn
	for i := range conns {
		raw, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		c := Client(raw, ccfg, Options{})
		t.Cleanup(func() { c.Close() })
		c.SetDeadline(time.Now().Add(time.Minute))
		got, m, err := sum256(c)
		if err != nil || m != int64(n) || got != want {
			t.Fatalf("connection %d: client read %d bytes, err %v, sha match %v", i, m, err, got == want)
		}
		c.Close()
		out = append(out, c)
	}
	if err := <-srvErr; err != nil {
		t.Fatal(err)
	}
	return out
}

// TestReadFromFlattensLimitedReaders: two nested LimitedReaders around a
// file reach the socket as one, so the kernel can sendfile, and every
// wrapper's N is lowered afterwards.
func TestReadFromFlattensLimitedReaders(t *testing.T) {
	f, err := os.CreateTemp(t.TempDir(), "src")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := io.Copy(f, payload(4, 10000)); err != nil {
		t.Fatal(err)
	}
	f.Seek(0, io.SeekStart)
	inner := &io.LimitedReader{R: f, N: 7000}
	outer := &io.LimitedReader{R: inner, N: 9000}
	var dst recordingReaderFrom
	n, err := readFromFlattened(&dst, outer)
	if err != nil || n != 7000 {
		t.Fatalf("copied %d, %v; want 7000", n, err)
	}
	lr, ok := dst.got.(*io.LimitedReader)
	if !ok || lr.R != io.Reader(f) || lr.N != 0 {
		t.Fatalf("socket got %T %+v, want one *io.LimitedReader over the *os.File", dst.got, dst.got)
	}
	if inner.N != 0 || outer.N != 2000 {
		t.Fatalf("wrapper N = %d, %d; want 0, 2000", inner.N, outer.N)
	}
	want, _, _ := sum256(io.LimitReader(payload(4, 10000), 7000))
	if got, _, _ := sum256(strings.NewReader(dst.data.String())); got != want {
		t.Fatal("bytes differ")
	}
	// One level is left to the standard library unchanged.
	var direct recordingReaderFrom
	single := &io.LimitedReader{R: strings.NewReader("abc"), N: 2}
	if n, err := readFromFlattened(&direct, single); n != 2 || err != nil || direct.got != io.Reader(single) {
		t.Fatalf("single LimitedReader: %d %v %T", n, err, direct.got)
	}
}

type recordingReaderFrom struct {
	got  io.Reader
	data strings.Builder
}

func (r *recordingReaderFrom) ReadFrom(src io.Reader) (int64, error) {
	r.got = src
	return io.Copy(&r.data, src)
}

// TestReadFromWriteToFallback: ReadFrom from a file and WriteTo into a
// file work through the userspace path.
func TestReadFromWriteToFallback(t *testing.T) {
	pr := tls13Pair(t)
	defer pr.close()
	dir := t.TempDir()
	src := filepath.Join(dir, "src")
	f, _ := os.Create(src)
	io.Copy(f, payload(5, 300000))
	f.Seek(0, io.SeekStart)
	defer f.Close()
	done := make(chan error, 1)
	go func() {
		_, err := pr.server.ReadFrom(&io.LimitedReader{R: &io.LimitedReader{R: f, N: 250000}, N: 200000})
		if err == nil {
			err = pr.server.CloseWrite()
		}
		done <- err
	}()
	got, n, err := sum256(pr.client)
	want, _, _ := sum256(payload(5, 200000))
	if err != nil || n != 200000 || got != want {
		t.Fatalf("client got %d bytes (%v), sha ok %v", n, err, got == want)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	out, _ := os.Create(filepath.Join(dir, "out"))
	defer out.Close()
	go func() {
		io.Copy(pr.client, payload(6, 100000))
		pr.client.CloseWrite()
	}()
	if n, err := pr.server.WriteTo(out); err != nil || n != 100000 {
		t.Fatalf("WriteTo: %d, %v", n, err)
	}
	out.Seek(0, io.SeekStart)
	got, _, _ = sum256(out)
	if want, _, _ := sum256(payload(6, 100000)); got != want {
		t.Fatal("WriteTo bytes differ")
	}
}

// TestTokenBucket: Burst at once, then PerSecond.
func TestTokenBucket(t *testing.T) {
	b := newTokenBucket(Rate{PerSecond: 2, Burst: 3})
	now := time.Unix(1000, 0)
	for i := range 3 {
		if !b.allow(now) {
			t.Fatalf("token %d of the burst refused", i)
		}
	}
	if b.allow(now) {
		t.Fatal("a fourth token at the same instant was allowed")
	}
	if !b.allow(now.Add(500 * time.Millisecond)) {
		t.Fatal("no token after 1/PerSecond")
	}
	if b.allow(now.Add(600 * time.Millisecond)) {
		t.Fatal("a token before the next refill")
	}
	if !b.allow(now.Add(time.Hour)) || !b.allow(now.Add(time.Hour)) || !b.allow(now.Add(time.Hour)) || b.allow(now.Add(time.Hour)) {
		t.Fatal("refill is not capped at Burst")
	}
	if d := newTokenBucket(Rate{}); d.rate != DefaultKeyUpdateLimit {
		t.Fatalf("zero Rate gives %+v, want the default", d.rate)
	}
}

// TestCryptoInfoLayout checks the structs against the kernel's layout
// (include/uapi/linux/tls.h): header, then iv, key, salt, rec_seq.
func TestCryptoInfoLayout(t *testing.T) {
	key, iv := bytes.Repeat([]byte{0xaa}, 16), []byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}
	info, err := cryptoInfo(tls.VersionTLS13, tls.TLS_AES_128_GCM_SHA256, key, iv, 7)
	if err != nil {
		t.Fatal(err)
	}
	want := binary.NativeEndian.AppendUint16(nil, 0x0304)
	want = binary.NativeEndian.AppendUint16(want, 51)
	want = append(want, iv[4:]...)
	want = append(want, key...)
	want = append(want, iv[:4]...)
	want = append(want, 0, 0, 0, 0, 0, 0, 0, 7)
	if !bytes.Equal(info, want) {
		t.Fatalf("AES-128-GCM TLS 1.3:\n got %x\nwant %x", info, want)
	}
	key32 := bytes.Repeat([]byte{0xbb}, 32)
	info, err = cryptoInfo(tls.VersionTLS13, tls.TLS_CHACHA20_POLY1305_SHA256, key32, iv, 1)
	if err != nil || len(info) != 4+12+32+8 || !bytes.Equal(info[4:16], iv) || info[len(info)-1] != 1 {
		t.Fatalf("ChaCha20: %x, %v", info, err)
	}
	// TLS 1.2 ChaCha20-Poly1305 (RFC 7905): the same struct, whole 12-byte
	// IV, no explicit nonce.
	info, err = cryptoInfo(tls.VersionTLS12, tls.TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256, key32, iv, 5)
	if err != nil || len(info) != 4+12+32+8 || binary.NativeEndian.Uint16(info[0:2]) != 0x0303 ||
		binary.NativeEndian.Uint16(info[2:4]) != 54 || !bytes.Equal(info[4:16], iv) || !bytes.Equal(info[16:48], key32) ||
		!bytes.Equal(info[48:], []byte{0, 0, 0, 0, 0, 0, 0, 5}) {
		t.Fatalf("ChaCha20 TLS 1.2: %x, %v", info, err)
	}
	if _, err := cryptoInfo(tls.VersionTLS12, tls.TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256, key32, iv[:4], 0); err == nil {
		t.Fatal("a 4-byte IV for TLS 1.2 ChaCha20 was accepted")
	}
	salt := []byte{9, 9, 9, 9}
	info, err = cryptoInfo(tls.VersionTLS12, tls.TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384, key32, salt, 1)
	// TLS 1.2: the explicit nonce ("iv") starts at rec_seq.
	if err != nil || len(info) != 4+8+32+4+8 || !bytes.Equal(info[4:12], info[len(info)-8:]) || !bytes.Equal(info[44:48], salt) {
		t.Fatalf("AES-256-GCM TLS 1.2: %x, %v", info, err)
	}
	if _, err := cryptoInfo(tls.VersionTLS13, tls.TLS_AES_128_GCM_SHA256, key32, iv, 0); err == nil {
		t.Fatal("a 32-byte key for AES-128 was accepted")
	}
	if _, err := cryptoInfo(tls.VersionTLS12, tls.TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA, key, salt, 0); err == nil {
		t.Fatal("a CBC suite was accepted")
	}
}

// benchClientEnv makes the test binary, started by BenchmarkHandshake, the
// benchmark's TLS client (TestMain): it handshakes with the address in the
// variable, one connection after the other, until it is killed. In its own
// process the client's CPU stays out of the server's getrusage figure.
// benchCAEnv names the PEM file of the CA that signed the server's
// certificate.
const (
	benchClientEnv = "KTLS_BENCH_HANDSHAKE_CLIENT"
	benchCAEnv     = "KTLS_BENCH_HANDSHAKE_CA"
)

func TestMain(m *testing.M) {
	if addr := os.Getenv(benchClientEnv); addr != "" {
		err := handshakeClient(addr, os.Getenv(benchCAEnv))
		fmt.Fprintf(os.Stderr, "handshake client: %v\n", err)
		os.Exit(1)
	}
	if os.Getenv(handoffChildEnv) != "" {
		if err := handoffChild(); err != nil {
			fmt.Fprintf(os.Stderr, "adopting process: %v\n", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// handshakeClient completes TLS 1.3 handshakes with addr until one fails
// other than by a shed (Shed: the server's access_denied in place of its
// ServerHello, BenchmarkHandshake's shed arm), which it takes as done.
func handshakeClient(addr, caFile string) error {
	pem, err := os.ReadFile(caFile)
	if err != nil {
		return err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return fmt.Errorf("no certificate in %s", caFile)
	}
	cfg := &tls.Config{RootCAs: pool, ServerName: "localhost", MinVersion: tls.VersionTLS13}
	for {
		c, err := tls.Dial("tcp", addr, cfg)
		if err != nil && err.Error() != "remote error: tls: access denied" {
			return err
		}
		if c != nil {
			c.Close()
		}
	}
}

// BenchmarkHandshake compares the server's CPU for a plain crypto/tls
// handshake with the engine's handshake plus offload setup: key capture
// through the per-connection config clone, record-bounded reads, and the
// TX and RX keys derived and laid out as the kernel's crypto_info, the
// same functions offload calls. The kernel calls are left out (TCP_ULP,
// TLS_TX, TLS_RX, the sock_diag query: a handful of syscalls, which a host
// without kTLS cannot make): the engine runs with Options.Disable, which
// stops before them on any kernel, and the benchmark derives the keys
// itself. The client runs in another process (benchClientEnv), so
// cpu-ns/op (getrusage of this process) is the server's alone. Both arms
// accept a fresh loopback TCP connection per iteration: over net.Pipe
// every small record-bounded read would be a goroutine rendezvous, a cost
// no kernel socket has.
func BenchmarkHandshake(b *testing.B) {
	p := newTestPKI(b)
	scfg, _ := p.configs(connCase{version: tls.VersionTLS13})
	caFile := p.ca.WriteFile(b, b.TempDir(), "ca")
	run := func(b *testing.B, handshake func(net.Conn) error) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			b.Fatal(err)
		}
		defer ln.Close()
		client := exec.Command(os.Args[0])
		client.Env = append(os.Environ(), benchClientEnv+"="+ln.Addr().String(), benchCAEnv+"="+caFile)
		client.Stderr = os.Stderr
		if err := client.Start(); err != nil {
			b.Fatal(err)
		}
		defer func() {
			client.Process.Kill()
			client.Wait()
		}()
		cpuBefore := cputest.Used(b)
		for b.Loop() {
			raw, err := ln.Accept()
			if err != nil {
				b.Fatal(err)
			}
			raw.SetDeadline(time.Now().Add(time.Minute))
			err = handshake(raw)
			raw.Close()
			if err != nil {
				b.Fatalf("server handshake: %v", err)
			}
		}
		// CPU time, unlike ns/op, barely moves with the load of other
		// processes on a shared machine.
		b.ReportMetric(float64(cputest.Used(b)-cpuBefore)/float64(b.N), "cpu-ns/op")
	}
	b.Run("crypto-tls", func(b *testing.B) {
		run(b, func(c net.Conn) error { return tls.Server(c, scfg).Handshake() })
	})
	// What a connection shed before its handshake costs the server: the
	// accept, the alert's write and the close.
	b.Run("shed", func(b *testing.B) {
		run(b, func(c net.Conn) error {
			if err := Shed(c); err != nil && !errors.Is(err, net.ErrClosed) {
				return err
			}
			return nil
		})
	})
	b.Run("ktls", func(b *testing.B) {
		run(b, func(c net.Conn) error {
			s := Server(c, scfg, Options{Disable: true})
			if err := s.Handshake(); err != nil {
				return err
			}
			state := s.ConnectionState()
			tx, rx, err := s.directionKeys(state)
			if err != nil {
				return err
			}
			for _, d := range []directionState{tx, rx} {
				if _, err := cryptoInfo(state.Version, state.CipherSuite, d.key, d.iv, d.seq); err != nil {
					return err
				}
			}
			return nil
		})
	})
}
