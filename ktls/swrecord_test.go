package ktls

import (
	"bytes"
	"crypto/sha256"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"syscall"
	"testing"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"golang.org/x/sys/unix"
)

// RFC 8448 section 3: the protected records sent after the handshake. The
// client's application data record is its first under the application key
// (sequence 0); the server's follows its NewSessionTicket (sequence 1);
// the client's close_notify follows its data (sequence 1). Both data
// records carry the 50 bytes 00 01 .. 31.
const (
	rfc8448ClientAppRecord = `17 03 03 00 43 a2 3f 70 54 b6 2c 94 d0 af fa fe 82 28 ba 55 cb ef ac ea 42 f9 14 aa 66 bc ab 3f
		2b 98 19 a8 a5 b4 6b 39 5b d5 4a 9a 20 44 1e 2b 62 97 4e 1f 5a 62 92 a2 97 70 14 bd 1e 3d ea e6 3a ee bb 21 69 49 15 e4`
	rfc8448ServerAppRecord = `17 03 03 00 43 2e 93 7e 11 ef 4a c7 40 e5 38 ad 36 00 5f c4 a4 69 32 fc 32 25 d0 5f 82 aa 1b 36
		e3 0e fa f9 7d 90 e6 df fc 60 2d cb 50 1a 59 a8 fc c4 9c 4b f2 e5 f0 a2 1c 00 47 c2 ab f3 32 54 0d d0 32 e1 67 c2 95 5d`
	rfc8448ClientAlertRecord = `17 03 03 00 13 c9 87 27 60 65 56 66 b7 4d 7f f1 15 3e fd 6d b6 d0 b0 e3`
)

func recordFromHex(t testing.TB, s string) ([5]byte, []byte) {
	t.Helper()
	b := unhex(t, s)
	var hdr [5]byte
	copy(hdr[:], b)
	return hdr, b[5:]
}

func TestRecordOpenRFC8448(t *testing.T) {
	payload := make([]byte, 50)
	for i := range payload {
		payload[i] = byte(i)
	}
	client, err := newRecordOpener(tls.VersionTLS13, tls.TLS_AES_128_GCM_SHA256, unhex(t, rfc8448ClientAppKey), unhex(t, rfc8448ClientAppIV), 0)
	if err != nil {
		t.Fatal(err)
	}
	hdr, body := recordFromHex(t, rfc8448ClientAppRecord)
	if typ, pt, err := client.Open(hdr, body); err != nil || typ != recordApplicationData || !bytes.Equal(pt, payload) {
		t.Fatalf("client data: type %d %x %v", typ, pt, err)
	}
	hdr, body = recordFromHex(t, rfc8448ClientAlertRecord)
	if typ, pt, err := client.Open(hdr, body); err != nil || typ != recordAlert || !bytes.Equal(pt, []byte{1, 0}) {
		t.Fatalf("client close_notify: type %d %x %v", typ, pt, err)
	}

	server, err := newRecordOpener(tls.VersionTLS13, tls.TLS_AES_128_GCM_SHA256, unhex(t, rfc8448ServerAppKey), unhex(t, rfc8448ServerAppIV), 1)
	if err != nil {
		t.Fatal(err)
	}
	hdr, body = recordFromHex(t, rfc8448ServerAppRecord)
	if typ, pt, err := server.Open(hdr, body); err != nil || typ != recordApplicationData || !bytes.Equal(pt, payload) {
		t.Fatalf("server data: type %d %x %v", typ, pt, err)
	}
}

// openGoTLS13Capture opens every protected client record of a captured
// TLS 1.3 session: the handshake flight with the client handshake secret,
// then application data and close_notify with the application secret.
func openGoTLS13Capture(t *testing.T, c *tlsCapture) {
	t.Helper()
	suite := c.state.CipherSuite
	opener := func(label string) *recordOpener {
		key, iv, err := trafficKeys(suite, c.keyLog.secret(t, label))
		if err != nil {
			t.Fatal(err)
		}
		o, err := newRecordOpener(tls.VersionTLS13, suite, key, iv, 0)
		if err != nil {
			t.Fatal(err)
		}
		return o
	}
	var protected []wireRecord
	for _, r := range splitRecords(t, c.clientToServer) {
		// The ClientHello and the compatibility ChangeCipherSpec are plaintext.
		if r.header[0] == recordApplicationData {
			protected = append(protected, r)
		}
	}
	// The client's handshake flight here is only its Finished (no client
	// certificate): one record.
	hs := opener("CLIENT_HANDSHAKE_TRAFFIC_SECRET")
	typ, fin, err := hs.Open(protected[0].header, protected[0].body)
	if err != nil || typ != recordHandshake || len(fin) < 4 || fin[0] != 20 {
		t.Fatalf("client Finished: type %d %x %v", typ, fin, err)
	}
	appData, types, alert := openAll(t, opener("CLIENT_TRAFFIC_SECRET_0"), protected[1:])
	if len(appData) != len(c.sent) || sha(appData) != sha(c.sent) {
		t.Fatalf("opened %d bytes sha256 %s, want %d bytes sha256 %s", len(appData), sha(appData), len(c.sent), sha(c.sent))
	}
	if types[len(types)-1] != recordAlert || !bytes.Equal(alert, []byte{1, 0}) {
		t.Fatalf("last record type %d %x, want close_notify", types[len(types)-1], alert)
	}
	t.Logf("%s: opened %d records, %d bytes, sha256 %s", tls.CipherSuiteName(suite), len(types), len(appData), sha(appData))
}

func TestRecordOpenGoTLS13(t *testing.T) {
	c := captureGoTLS(t, tls.VersionTLS13, nil, 300<<10)
	if c.state.Version != tls.VersionTLS13 {
		t.Fatalf("negotiated %#04x", c.state.Version)
	}
	openGoTLS13Capture(t, c)
}

// chachaChildEnv marks the child process of TestRecordOpenGoTLS13ChaCha20.
const chachaChildEnv = "KTLS_SWRECORD_CHACHA_CHILD"

// TestRecordOpenGoTLS13ChaCha20 runs the capture in a child process with
// GODEBUG=cpu.aes=off: without AES hardware crypto/tls prefers
// ChaCha20-Poly1305, and that switch is read once at process start.
func TestRecordOpenGoTLS13ChaCha20(t *testing.T) {
	if os.Getenv(chachaChildEnv) == "1" {
		c := captureGoTLS(t, tls.VersionTLS13, nil, 300<<10)
		if c.state.CipherSuite != tls.TLS_CHACHA20_POLY1305_SHA256 {
			t.Fatalf("child negotiated %s, want TLS_CHACHA20_POLY1305_SHA256", tls.CipherSuiteName(c.state.CipherSuite))
		}
		openGoTLS13Capture(t, c)
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestRecordOpenGoTLS13ChaCha20$", "-test.v")
	cmd.Env = append(os.Environ(), chachaChildEnv+"=1", "GODEBUG=cpu.aes=off")
	out, err := cmd.CombinedOutput()
	i := bytes.Index(out, []byte("TLS_CHACHA20_POLY1305_SHA256: opened"))
	if err != nil || i < 0 {
		t.Fatalf("child: %v\n%s", err, out)
	}
	t.Logf("child: %s", bytes.SplitN(out[i:], []byte("\n"), 2)[0])
}

// TLS 1.3 AES-256-GCM: crypto/tls never picks it against itself (its
// preference puts AES-128 first and the order is not configurable for TLS
// 1.3), so these records come from the independent test sealer, with every
// padding and length shape.
func TestRecordOpenTLS13SealedAllSuites(t *testing.T) {
	for _, suite := range []uint16{tls.TLS_AES_128_GCM_SHA256, tls.TLS_AES_256_GCM_SHA384, tls.TLS_CHACHA20_POLY1305_SHA256} {
		t.Run(tls.CipherSuiteName(suite), func(t *testing.T) {
			key, iv, err := trafficKeys(suite, testSecret(t, suite))
			if err != nil {
				t.Fatal(err)
			}
			sealer := newTestSealer(t, tls.VersionTLS13, suite, key, iv)
			opener, err := newRecordOpener(tls.VersionTLS13, suite, key, iv, 0)
			if err != nil {
				t.Fatal(err)
			}
			for _, c := range []struct {
				typ     uint8
				length  int
				padding int
			}{
				{recordApplicationData, 0, 0}, // empty application data is legal in TLS 1.3
				{recordApplicationData, 1, 0},
				{recordApplicationData, 1000, 255},               // padded
				{recordHandshake, 5, 3000},                       // padded control record
				{recordApplicationData, maxPlaintext, 0},         // full record
				{recordApplicationData, 100, maxPlaintext - 100}, // padding up to the limit
				{recordAlert, 2, 0},
			} {
				pt := bytes.Repeat([]byte{0xa5}, c.length)
				rec := sealer.seal(c.typ, pt, c.padding)
				typ, got, err := opener.Open([5]byte(rec[:5]), rec[5:])
				if err != nil || typ != c.typ || !bytes.Equal(got, pt) {
					t.Fatalf("type %d len %d padding %d: got type %d, %d bytes, %v", c.typ, c.length, c.padding, typ, len(got), err)
				}
			}
		})
	}
}

// testSecret returns a fixed TLS 1.3 traffic secret of the suite's hash length.
func testSecret(t testing.TB, suite uint16) []byte {
	t.Helper()
	cs, err := suiteFor(tls.VersionTLS13, suite)
	if err != nil {
		t.Fatal(err)
	}
	return bytes.Repeat([]byte{byte(suite)}, cs.hash().Size())
}

// TestRecordOpenTLS12Sealed checks the TLS 1.2 opener against the
// independent sealer for every AEAD suite and the size extremes.
func TestRecordOpenTLS12Sealed(t *testing.T) {
	for _, suite := range []uint16{tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, tls.TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384, tls.TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256} {
		t.Run(tls.CipherSuiteName(suite), func(t *testing.T) {
			kb, err := tls12Keys(suite, make([]byte, 48), make([]byte, 32), make([]byte, 32))
			if err != nil {
				t.Fatal(err)
			}
			sealer := newTestSealer(t, tls.VersionTLS12, suite, kb.ClientKey, kb.ClientIV)
			opener, err := newRecordOpener(tls.VersionTLS12, suite, kb.ClientKey, kb.ClientIV, 0)
			if err != nil {
				t.Fatal(err)
			}
			for _, n := range []int{0, 1, 1000, maxPlaintext} {
				pt := bytes.Repeat([]byte{0x5a}, n)
				rec := sealer.seal(recordApplicationData, pt, 0)
				typ, got, err := opener.Open([5]byte(rec[:5]), rec[5:])
				if err != nil || typ != recordApplicationData || !bytes.Equal(got, pt) {
					t.Fatalf("len %d: type %d, %d bytes, %v", n, typ, len(got), err)
				}
			}
		})
	}
}

func TestRecordOpenRejects(t *testing.T) {
	key13, iv13, err := trafficKeys(tls.TLS_AES_128_GCM_SHA256, make([]byte, 32))
	if err != nil {
		t.Fatal(err)
	}
	kb, err := tls12Keys(tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, make([]byte, 48), make([]byte, 32), make([]byte, 32))
	if err != nil {
		t.Fatal(err)
	}
	type maker func(s *testSealer) []byte
	flip := func(i int) func([]byte) []byte {
		return func(rec []byte) []byte { rec[(i+len(rec))%len(rec)] ^= 1; return rec }
	}
	for _, c := range []struct {
		name    string
		version uint16
		openSeq uint64
		make    maker
		mangle  func([]byte) []byte
		want    error
	}{
		{"tls13 tampered tag", tls.VersionTLS13, 0, data(100), flip(-1), errBadRecordMAC},
		{"tls13 tampered ciphertext", tls.VersionTLS13, 0, data(100), flip(5), errBadRecordMAC},
		{"tls13 tampered header version", tls.VersionTLS13, 0, data(100), flip(2), errBadRecordMAC},
		{"tls13 wrong sequence", tls.VersionTLS13, 1, data(100), nil, errBadRecordMAC},
		{"tls13 length mismatch", tls.VersionTLS13, 0, data(100), func(r []byte) []byte { return r[:len(r)-1] }, errDecodeError},
		{"tls13 outer type handshake", tls.VersionTLS13, 0, data(100), func(r []byte) []byte { r[0] = recordHandshake; return r }, errUnexpectedMessage},
		{"tls13 too short", tls.VersionTLS13, 0, data(100), func(r []byte) []byte { return withLen(r[:5+16]) }, errBadRecordMAC},
		{"tls13 ciphertext overflow", tls.VersionTLS13, 0, data(100), func([]byte) []byte {
			r := withLen(make([]byte, 5+maxCiphertextTLS13+1))
			r[0] = recordApplicationData
			return r
		}, errRecordOverflow},
		{"tls13 inner plaintext overflow", tls.VersionTLS13, 0, func(s *testSealer) []byte { return s.seal(recordApplicationData, make([]byte, maxPlaintext), 1) }, nil, errRecordOverflow},
		{"tls13 all-zero inner plaintext", tls.VersionTLS13, 0, func(s *testSealer) []byte { return s.sealInner(make([]byte, 40)) }, nil, errUnexpectedMessage},
		{"tls13 empty inner plaintext", tls.VersionTLS13, 0, func(s *testSealer) []byte { return s.sealInner(nil) }, nil, errBadRecordMAC},
		{"tls13 inner change_cipher_spec", tls.VersionTLS13, 0, func(s *testSealer) []byte { return s.seal(recordChangeCipherSpec, []byte{1}, 0) }, nil, errUnexpectedMessage},
		{"tls12 tampered tag", tls.VersionTLS12, 0, data(100), flip(-1), errBadRecordMAC},
		{"tls12 tampered explicit nonce", tls.VersionTLS12, 0, data(100), flip(5), errBadRecordMAC},
		{"tls12 tampered type", tls.VersionTLS12, 0, data(100), func(r []byte) []byte { r[0] = recordHandshake; return r }, errBadRecordMAC},
		{"tls12 wrong sequence", tls.VersionTLS12, 3, data(100), nil, errBadRecordMAC},
		{"tls12 no explicit nonce", tls.VersionTLS12, 0, data(100), func(r []byte) []byte { return withLen(r[:5+7]) }, errBadRecordMAC},
		{"tls12 no tag", tls.VersionTLS12, 0, data(100), func(r []byte) []byte { return withLen(r[:5+8+15]) }, errBadRecordMAC},
		{"tls12 plaintext overflow", tls.VersionTLS12, 0, func(s *testSealer) []byte { return s.seal(recordApplicationData, make([]byte, maxPlaintext+1), 0) }, nil, errRecordOverflow},
		{"tls12 ciphertext overflow", tls.VersionTLS12, 0, data(100), func([]byte) []byte {
			r := withLen(make([]byte, 5+maxCiphertextTLS12+1))
			r[0] = recordApplicationData
			return r
		}, errRecordOverflow},
		{"tls12 change_cipher_spec", tls.VersionTLS12, 0, data(100), func(r []byte) []byte { r[0] = recordChangeCipherSpec; return r }, errUnexpectedMessage},
	} {
		t.Run(c.name, func(t *testing.T) {
			var sealer *testSealer
			var opener *recordOpener
			var err error
			if c.version == tls.VersionTLS13 {
				sealer = newTestSealer(t, c.version, tls.TLS_AES_128_GCM_SHA256, key13, iv13)
				opener, err = newRecordOpener(c.version, tls.TLS_AES_128_GCM_SHA256, key13, iv13, c.openSeq)
			} else {
				sealer = newTestSealer(t, c.version, tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, kb.ClientKey, kb.ClientIV)
				opener, err = newRecordOpener(c.version, tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, kb.ClientKey, kb.ClientIV, c.openSeq)
			}
			if err != nil {
				t.Fatal(err)
			}
			rec := c.make(sealer)
			if c.mangle != nil {
				rec = c.mangle(rec)
			}
			typ, pt, err := opener.Open([5]byte(rec[:5]), rec[5:])
			if !errors.Is(err, c.want) {
				t.Fatalf("Open = type %d, %d bytes, err %v; want %v", typ, len(pt), err, c.want)
			}
			if opener.seq != c.openSeq {
				t.Fatalf("sequence moved to %d on a failed Open", opener.seq)
			}
			if got := IsBadRecord(fmt.Errorf("read: %w", err)); got != (c.want == errBadRecordMAC) {
				t.Errorf("IsBadRecord(%v) = %v", err, got)
			}
			t.Logf("%v", err)
		})
	}
}

// IsBadRecord takes the kernel's EBADMSG however the read, recvmsg or
// splice that met it wraps it, and crypto/tls's own bad_record_mac, but not
// the peer's alert of that name (a record we sent failed at the peer) nor
// other read errors. (The opener's errors: TestRecordOpenRejects; crypto/tls's
// real error through a tunnel: TestSandboxBadRecord.)
func TestIsBadRecord(t *testing.T) {
	for _, c := range []struct {
		err  error
		want bool
	}{
		{fmt.Errorf("source: %w", os.NewSyscallError("splice source", syscall.EBADMSG)), true},
		{&net.OpError{Op: "read", Err: os.NewSyscallError("read", syscall.EBADMSG)}, true},
		{&net.OpError{Op: "local error", Err: tls.AlertError(alertBadRecordMAC)}, true},
		{&net.OpError{Op: "remote error", Err: tls.AlertError(alertBadRecordMAC)}, false},
		{&net.OpError{Op: "local error", Err: tls.AlertError(alertDecodeError)}, false},
		{AlertError(alertBadRecordMAC), false},
		{os.NewSyscallError("splice source", syscall.EIO), false},
		{io.EOF, false},
		{nil, false},
	} {
		if got := IsBadRecord(c.err); got != c.want {
			t.Errorf("IsBadRecord(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}

// data seals n bytes of application data.
func data(n int) func(*testSealer) []byte {
	return func(s *testSealer) []byte { return s.seal(recordApplicationData, make([]byte, n), 0) }
}

// withLen rewrites a record's length field to match its body.
func withLen(rec []byte) []byte {
	binary.BigEndian.PutUint16(rec[3:5], uint16(len(rec)-5))
	return rec
}

func TestRecordOpenSequenceExhausted(t *testing.T) {
	key, iv, err := trafficKeys(tls.TLS_AES_128_GCM_SHA256, make([]byte, 32))
	if err != nil {
		t.Fatal(err)
	}
	o, err := newRecordOpener(tls.VersionTLS13, tls.TLS_AES_128_GCM_SHA256, key, iv, ^uint64(0))
	if err != nil {
		t.Fatal(err)
	}
	s := newTestSealer(t, tls.VersionTLS13, tls.TLS_AES_128_GCM_SHA256, key, iv)
	s.seq = ^uint64(0)
	rec := s.seal(recordApplicationData, []byte("x"), 0)
	var re *recordError
	if _, _, err := o.Open([5]byte(rec[:5]), rec[5:]); !errors.As(err, &re) || re.Alert != alertInternalError {
		t.Fatalf("Open at the last sequence number = %v, want internal_error", err)
	}
}

func TestRecordOpenerRekey(t *testing.T) {
	suite := uint16(tls.TLS_CHACHA20_POLY1305_SHA256)
	secret := bytes.Repeat([]byte{1}, 32)
	key, iv, err := trafficKeys(suite, secret)
	if err != nil {
		t.Fatal(err)
	}
	o, err := newRecordOpener(tls.VersionTLS13, suite, key, iv, 41)
	if err != nil {
		t.Fatal(err)
	}
	next, err := nextTrafficSecret(suite, secret)
	if err != nil {
		t.Fatal(err)
	}
	nkey, niv, err := trafficKeys(suite, next)
	if err != nil {
		t.Fatal(err)
	}
	if err := o.Rekey(nkey, niv); err != nil {
		t.Fatal(err)
	}
	if o.seq != 0 {
		t.Fatalf("sequence after Rekey = %d, want 0", o.seq)
	}
	s := newTestSealer(t, tls.VersionTLS13, suite, nkey, niv)
	for i := range 3 {
		rec := s.seal(recordApplicationData, []byte{byte(i)}, 0)
		if _, pt, err := o.Open([5]byte(rec[:5]), rec[5:]); err != nil || !bytes.Equal(pt, []byte{byte(i)}) {
			t.Fatalf("record %d after Rekey: %x %v", i, pt, err)
		}
	}
	if err := o.Rekey(nkey[:16], niv); err == nil {
		t.Fatal("Rekey accepted a 16-byte ChaCha20 key")
	}

	kb, err := tls12Keys(tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, make([]byte, 48), make([]byte, 32), make([]byte, 32))
	if err != nil {
		t.Fatal(err)
	}
	o12, err := newRecordOpener(tls.VersionTLS12, tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, kb.ClientKey, kb.ClientIV, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := o12.Rekey(kb.ServerKey, kb.ServerIV); err == nil {
		t.Fatal("TLS 1.2 opener accepted a KeyUpdate rekey")
	}
}

func TestNewRecordOpenerRejects(t *testing.T) {
	k16, k32, iv12, iv4 := make([]byte, 16), make([]byte, 32), make([]byte, 12), make([]byte, 4)
	for _, c := range []struct {
		name           string
		version, suite uint16
		key, iv        []byte
	}{
		{"tls10", tls.VersionTLS10, tls.TLS_AES_128_GCM_SHA256, k16, iv12},
		{"tls13 with tls12 suite", tls.VersionTLS13, tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, k16, iv12},
		{"tls12 with tls13 suite", tls.VersionTLS12, tls.TLS_AES_128_GCM_SHA256, k16, iv4},
		{"tls13 aes128 long key", tls.VersionTLS13, tls.TLS_AES_128_GCM_SHA256, k32, iv12},
		{"tls13 aes256 short key", tls.VersionTLS13, tls.TLS_AES_256_GCM_SHA384, k16, iv12},
		{"tls13 short iv", tls.VersionTLS13, tls.TLS_AES_128_GCM_SHA256, k16, iv4},
		{"tls12 gcm 12-byte iv", tls.VersionTLS12, tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, k16, iv12},
		{"tls12 chacha 4-byte iv", tls.VersionTLS12, tls.TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256, k32, iv4},
	} {
		if _, err := newRecordOpener(c.version, c.suite, c.key, c.iv, 0); err == nil {
			t.Errorf("%s: accepted", c.name)
		}
	}
}

// TestRecordOpenDoesNotAllocate checks the happy path decrypts in place.
func TestRecordOpenDoesNotAllocate(t *testing.T) {
	for _, version := range []uint16{tls.VersionTLS13, tls.VersionTLS12} {
		o, rec := benchRecord(t, version, tls.TLS_AES_128_GCM_SHA256, 16<<10)
		body := make([]byte, len(rec)-5)
		allocs := testing.AllocsPerRun(50, func() {
			copy(body, rec[5:])
			o.seq = 0
			if _, _, err := o.Open([5]byte(rec[:5]), body); err != nil {
				t.Fatal(err)
			}
		})
		if allocs != 0 {
			t.Errorf("TLS %#04x: %v allocations per Open, want 0", version, allocs)
		}
	}
}

// benchRecord returns an opener at sequence 0 and one sealed record of n
// bytes of application data for it. For TLS 1.2 the suite is mapped to
// its ECDHE counterpart.
func benchRecord(t testing.TB, version, suite uint16, n int) (*recordOpener, []byte) {
	t.Helper()
	var key, iv []byte
	if version == tls.VersionTLS13 {
		var err error
		if key, iv, err = trafficKeys(suite, testSecret(t, suite)); err != nil {
			t.Fatal(err)
		}
	} else {
		suite = map[uint16]uint16{
			tls.TLS_AES_128_GCM_SHA256:       tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
			tls.TLS_AES_256_GCM_SHA384:       tls.TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
			tls.TLS_CHACHA20_POLY1305_SHA256: tls.TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
		}[suite]
		kb, err := tls12Keys(suite, make([]byte, 48), make([]byte, 32), make([]byte, 32))
		if err != nil {
			t.Fatal(err)
		}
		key, iv = kb.ClientKey, kb.ClientIV
	}
	o, err := newRecordOpener(version, suite, key, iv, 0)
	if err != nil {
		t.Fatal(err)
	}
	return o, newTestSealer(t, version, suite, key, iv).seal(recordApplicationData, make([]byte, n), 0)
}

// BenchmarkRecordOpen16K opens full 16 KiB records; each iteration also
// copies the 16 KiB ciphertext back, since Open decrypts in place.
func BenchmarkRecordOpen16K(b *testing.B) {
	for _, c := range []struct {
		name           string
		version, suite uint16
	}{
		{"TLS13-AES128GCM", tls.VersionTLS13, tls.TLS_AES_128_GCM_SHA256},
		{"TLS13-AES256GCM", tls.VersionTLS13, tls.TLS_AES_256_GCM_SHA384},
		{"TLS13-ChaCha20Poly1305", tls.VersionTLS13, tls.TLS_CHACHA20_POLY1305_SHA256},
		{"TLS12-AES128GCM", tls.VersionTLS12, tls.TLS_AES_128_GCM_SHA256},
	} {
		b.Run(c.name, func(b *testing.B) {
			o, rec := benchRecord(b, c.version, c.suite, maxPlaintext)
			body := make([]byte, len(rec)-5)
			b.SetBytes(maxPlaintext)
			b.ReportAllocs()
			for b.Loop() {
				copy(body, rec[5:])
				o.seq = 0
				if _, _, err := o.Open([5]byte(rec[:5]), body); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// FuzzRecordOpen feeds arbitrary records to TLS 1.3 and TLS 1.2 openers:
// Open must never panic, must return a recordError on failure, and must
// only return plaintext that fits in the body it was given.
func FuzzRecordOpen(f *testing.F) {
	key13, iv13, err := trafficKeys(tls.TLS_AES_128_GCM_SHA256, make([]byte, 32))
	if err != nil {
		f.Fatal(err)
	}
	kb, err := tls12Keys(tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, make([]byte, 48), make([]byte, 32), make([]byte, 32))
	if err != nil {
		f.Fatal(err)
	}
	s13 := newTestSealer(f, tls.VersionTLS13, tls.TLS_AES_128_GCM_SHA256, key13, iv13)
	s12 := newTestSealer(f, tls.VersionTLS12, tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, kb.ClientKey, kb.ClientIV)
	f.Add(true, s13.seal(recordApplicationData, []byte("hello"), 7))
	f.Add(true, s13.sealInner(make([]byte, 20)))
	f.Add(true, s13.seal(recordAlert, []byte{1, 0}, 0))
	f.Add(false, s12.seal(recordApplicationData, []byte("hello"), 0))
	f.Add(false, s12.seal(recordHandshake, []byte{20, 0, 0, 12}, 0))
	f.Add(true, []byte{23, 3, 3, 0, 0})
	f.Add(false, []byte{23, 3, 3, 0, 1, 0})
	f.Fuzz(func(t *testing.T, tls13 bool, rec []byte) {
		if len(rec) < 5 {
			return
		}
		var o *recordOpener
		var err error
		if tls13 {
			o, err = newRecordOpener(tls.VersionTLS13, tls.TLS_AES_128_GCM_SHA256, key13, iv13, 0)
		} else {
			o, err = newRecordOpener(tls.VersionTLS12, tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, kb.ClientKey, kb.ClientIV, 0)
		}
		if err != nil {
			t.Fatal(err)
		}
		body := bytes.Clone(rec[5:])
		_, pt, err := o.Open([5]byte(rec[:5]), body)
		var re *recordError
		switch {
		case err != nil && !errors.As(err, &re):
			t.Fatalf("error %v is not a recordError", err)
		case err == nil && (len(pt) > len(body) || len(pt) > maxPlaintext):
			t.Fatalf("plaintext of %d bytes from a %d-byte body", len(pt), len(body))
		case err == nil && o.seq != 1:
			t.Fatalf("sequence %d after one successful Open", o.seq)
		}
	})
}

// TestKernelTXRecordsOpenInGo is the "seal only" data path end to end: the
// kernel seals records (TLS_TX with keys from the key schedule, plain
// write(2) of the payload, then a close_notify through sendmsg with
// TLS_SET_RECORD_TYPE) and the userspace opener, given the same keys, must
// open exactly what the kernel put on the wire. Every suite the kernel
// offers is tried; KTLS_TEST_MIB sets the payload size (default 4 MiB).
func TestKernelTXRecordsOpenInGo(t *testing.T) {
	kerneltest.Require(t)
	n := bulkSize(t, 4)
	caps := Probe()
	for _, s := range probeSuites() {
		name := tls.VersionName(s.version) + "/" + tls.CipherSuiteName(s.id)
		if !caps.Supports(s.version, s.id, false) {
			t.Logf("%s: this kernel does not take it as TX key (probe), not tried", name)
			continue
		}
		t.Run(name, func(t *testing.T) { kernelSealGoOpen(t, s.version, s.id, n) })
	}
}

func kernelSealGoOpen(t *testing.T, version, suite uint16, n int) {
	var key, iv []byte
	var err error
	if version == tls.VersionTLS13 {
		key, iv, err = trafficKeys(suite, testSecret(t, suite))
	} else {
		var kb tls12KeyBlock
		kb, err = tls12Keys(suite, bytes.Repeat([]byte{3}, 48), bytes.Repeat([]byte{1}, 32), bytes.Repeat([]byte{2}, 32))
		key, iv = kb.ServerKey, kb.ServerIV
	}
	if err != nil {
		t.Fatal(err)
	}
	info, err := cryptoInfo(version, suite, key, iv, 0)
	if err != nil {
		t.Fatal(err)
	}
	want, _, _ := sum256(payload(7, n))

	reader, sealer := loopbackPair(t)
	rc := syscallConn(t, sealer)
	var wire []byte
	var readErr error
	done := make(chan struct{})
	go func() {
		defer close(done)
		wire, readErr = io.ReadAll(reader)
	}()
	stat := kerneltest.StatDelta(t, func() {
		err = controlFD(rc, func(fd int) error {
			if err := unix.SetsockoptString(fd, unix.IPPROTO_TCP, unix.TCP_ULP, "tls"); err != nil {
				return err
			}
			return setsockoptBytes(fd, unix.SOL_TLS, optTLSTX, info)
		})
		if err != nil {
			return
		}
		if _, err = io.Copy(sealer, payload(7, n)); err != nil {
			return
		}
		oob := recordTypeCmsg(recordAlert)
		var serr error
		if err = rc.Write(func(fd uintptr) bool {
			_, serr = unix.SendmsgN(int(fd), []byte{1, 0}, oob, nil, 0)
			return serr != unix.EAGAIN
		}); err == nil {
			err = serr
		}
		sealer.Close()
		<-done
	})
	if err != nil {
		t.Fatalf("kernel TX: %v", err)
	}
	if readErr != nil {
		t.Fatal(readErr)
	}
	if stat["TlsTxSw"] != 1 {
		t.Fatalf("tls_stat moved %v, want TlsTxSw +1", stat)
	}

	opener, err := newRecordOpener(version, suite, key, iv, 0)
	if err != nil {
		t.Fatal(err)
	}
	recs := splitRecords(t, wire)
	appData, types, alert := openAll(t, opener, recs)
	if got := sha256.Sum256(appData); got != want || len(appData) != n {
		t.Fatalf("opened %d bytes sha256 %x, want %d bytes sha256 %x", len(appData), got, n, want)
	}
	if types[len(types)-1] != recordAlert || !bytes.Equal(alert, []byte{1, 0}) {
		t.Fatalf("last record type %d %x, want close_notify", types[len(types)-1], alert)
	}
	t.Logf("kernel sealed %d records (%d wire bytes), Go opened %d bytes, sha256 %x", len(recs), len(wire), len(appData), want)
}
