package preamble

import (
	"bytes"
	"crypto/ed25519"
	"encoding/binary"
	"encoding/hex"
	"flag"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

var update = flag.Bool("update", false, "rewrite testdata/*.hex from the generators")

// The example key, clock and claims of docs/preamble.md: anyone can rebuild
// the worked example from these.
var (
	exampleSeed    = seq(0x00, 32)
	exampleKey     = ed25519.NewKeyFromSeed(exampleSeed)
	examplePub     = exampleKey.Public().(ed25519.PublicKey)
	exampleKeyID   = "example-1"
	exampleIssued  = uint64(1767225600) // 2026-01-01T00:00:00Z
	exampleNow     = time.Unix(int64(exampleIssued)+1, 0)
	exampleNonce   = seq(0xa0, 16)
	exampleBinding = bytes.Repeat([]byte{0x42}, 32)
)

func seq(start byte, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = start + byte(i)
	}
	return b
}

// rawFrame is every wire field, written by this test's own encoder
// (buildFrame) straight from the spec so that malformed frames can be signed.
type rawFrame struct {
	magic      string
	version    byte
	reserved   byte
	lenDelta   int // added to the header's body length
	keyID      string
	kidLen     int // when non-zero, written as the key_id length instead of the true one
	iat, exp   uint64
	nonce      []byte
	sandboxID  string
	sidLen     int // when non-zero, written as the sandbox_id length instead of the true one
	family     byte
	addr       []byte
	port       uint16
	binding    []byte
	bindLen    int    // when non-zero, written as the binding length instead of the true one
	extensions []byte // raw TLV area
	extLen     int    // when non-zero, written as ext_length instead of the true one
	gap        []byte // bytes between the extensions and the signature
	signer     ed25519.PrivateKey
	flipSig    bool
	cut        int // bytes dropped from the end
}

func exampleFrame() rawFrame {
	return rawFrame{
		magic: "KTLP", version: 1, keyID: exampleKeyID,
		iat: exampleIssued, exp: exampleIssued + 30, nonce: exampleNonce,
		sandboxID: "sbx-0123.example_a", family: 4, addr: []byte{10, 1, 2, 3}, port: 8080,
		signer: exampleKey,
	}
}

// target sets the address fields to ip in the family its text form names:
// an IPv4-mapped IPv6 address stays 16 bytes in family 6.
func (f *rawFrame) target(ip string) {
	a := netip.MustParseAddr(ip)
	f.family, f.addr = 6, a.AsSlice()
	if a.Is4() {
		f.family = 4
	}
}

func tlv(typ uint16, value string) []byte {
	b := binary.BigEndian.AppendUint16(nil, typ)
	b = binary.BigEndian.AppendUint16(b, uint16(len(value)))
	return append(b, value...)
}

func buildFrame(f rawFrame) []byte {
	var body []byte
	kidLen := len(f.keyID)
	if f.kidLen != 0 {
		kidLen = f.kidLen
	}
	body = append(body, byte(kidLen))
	body = append(body, f.keyID...)
	body = binary.BigEndian.AppendUint64(body, f.iat)
	body = binary.BigEndian.AppendUint64(body, f.exp)
	body = append(body, f.nonce...)
	sidLen := len(f.sandboxID)
	if f.sidLen != 0 {
		sidLen = f.sidLen
	}
	body = append(body, byte(sidLen))
	body = append(body, f.sandboxID...)
	body = append(body, f.family)
	body = append(body, f.addr...)
	body = binary.BigEndian.AppendUint16(body, f.port)
	bindLen := len(f.binding)
	if f.bindLen != 0 {
		bindLen = f.bindLen
	}
	body = append(body, byte(bindLen))
	body = append(body, f.binding...)
	extLen := len(f.extensions)
	if f.extLen != 0 {
		extLen = f.extLen
	}
	body = binary.BigEndian.AppendUint16(body, uint16(extLen))
	body = append(body, f.extensions...)
	body = append(body, f.gap...)
	hdr := []byte(f.magic)
	hdr = append(hdr, f.version, f.reserved)
	hdr = binary.BigEndian.AppendUint16(hdr, uint16(len(body)+64+f.lenDelta))
	signed := append(hdr, body...)
	sig := ed25519.Sign(f.signer, append([]byte("caddy-ktls sandbox preamble v1\x00"), signed...))
	if f.flipSig {
		sig[10] ^= 0x01
	}
	frame := append(signed, sig...)
	return frame[:len(frame)-f.cut]
}

// goldenCase is one vector: its file name, how to build it, and what a
// verifier configured as in goldenVerifier must say about it.
type goldenCase struct {
	name           string
	reason         Reason // "" for a valid frame
	requireBinding bool
	build          func(f *rawFrame)
}

var goldenCases = []goldenCase{
	{"valid-ipv4", "", false, func(f *rawFrame) {}},
	{"valid-ipv6-bound", "", true, func(f *rawFrame) {
		f.target("fd00::1234")
		f.port = 443
		f.binding = exampleBinding
	}},
	{"valid-noncritical-extension", "", false, func(f *rawFrame) {
		f.extensions = append(tlv(0x0001, "hello"), tlv(0x7fff, "")...)
	}},
	{"valid-client-identity", "", false, func(f *rawFrame) {
		f.extensions = tlv(0x0010, "\x04\xc0\x00\x02\x07\xc3\x50alice@example.com")
	}},
	{"valid-client-identity-ipv6", "", false, func(f *rawFrame) {
		f.extensions = append(tlv(0x0001, "hello"), tlv(0x0010, "\x06\x20\x01\x0d\xb8\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x01\x01\xbb")...)
	}},
	// Beyond ASCII: é (U+00EB) and the emoji sequence 👩‍💻, whose zero
	// width joiner U+200D is a format character that §3.1 lets through.
	{"valid-client-identity-utf8", "", false, func(f *rawFrame) {
		f.extensions = tlv(0x0010, "\x04\xc0\x00\x02\x07\xc3\x50zo\u00eb \U0001f469\u200d\U0001f4bb")
	}},
	{"reject-bad-magic", ReasonBadMagic, false, func(f *rawFrame) { f.magic = "PROX" }},
	{"reject-bad-version", ReasonBadVersion, false, func(f *rawFrame) { f.version = 2 }},
	{"reject-oversized", ReasonOversized, false, func(f *rawFrame) { f.extensions = tlv(0x0001, strings.Repeat("x", 900)) }},
	{"reject-truncated", ReasonTruncated, false, func(f *rawFrame) { f.cut = 10 }},
	{"reject-trailing-bytes", ReasonTrailingBytes, false, func(f *rawFrame) { f.gap = []byte{0, 0, 0} }},
	{"reject-malformed", ReasonMalformed, false, func(f *rawFrame) { f.reserved = 1 }},
	{"reject-bad-key-id", ReasonBadKeyID, false, func(f *rawFrame) { f.keyID = "example 1" }},
	{"reject-bad-sandbox-id", ReasonBadSandboxID, false, func(f *rawFrame) { f.sandboxID = "sbx/../etc" }},
	{"reject-bad-sandbox-id-uppercase", ReasonBadSandboxID, false, func(f *rawFrame) { f.sandboxID = "sbx-0123.example_A" }},
	{"reject-bad-sandbox-id-dots", ReasonBadSandboxID, false, func(f *rawFrame) { f.sandboxID = ".." }},
	{"reject-bad-sandbox-id-leading-dot", ReasonBadSandboxID, false, func(f *rawFrame) { f.sandboxID = ".sbx" }},
	{"reject-bad-target", ReasonBadTarget, false, func(f *rawFrame) { f.port = 0 }},
	{"reject-bad-target-family", ReasonBadTarget, false, func(f *rawFrame) { f.family = 5 }},
	{"reject-bad-target-unspecified-ipv4", ReasonBadTarget, false, func(f *rawFrame) { f.target("0.0.0.0") }},
	{"reject-bad-target-unspecified-ipv6", ReasonBadTarget, false, func(f *rawFrame) { f.target("::") }},
	{"reject-bad-target-multicast-ipv4", ReasonBadTarget, false, func(f *rawFrame) { f.target("224.0.0.1") }},
	{"reject-bad-target-multicast-ipv6", ReasonBadTarget, false, func(f *rawFrame) { f.target("ff02::1") }},
	{"reject-bad-target-broadcast", ReasonBadTarget, false, func(f *rawFrame) { f.target("255.255.255.255") }},
	{"reject-bad-target-ipv4-mapped", ReasonBadTarget, false, func(f *rawFrame) { f.target("::ffff:10.1.2.3") }},
	{"reject-bad-target-ipv4-compatible", ReasonBadTarget, false, func(f *rawFrame) { f.target("::10.1.2.3") }},
	// 64:ff9b:1::/48 with the RFC 6052 u octet (bits 64-71) 0xff.
	{"reject-bad-target-nat64-u-octet", ReasonBadTarget, false, func(f *rawFrame) { f.target("64:ff9b:1:0:ff00::a01:203") }},
	{"reject-bad-extension", ReasonBadExtension, false, func(f *rawFrame) {
		f.extensions = append(tlv(0x0002, "b"), tlv(0x0001, "a")...)
	}},
	{"reject-bad-extension-client-identity-family", ReasonBadExtension, false, func(f *rawFrame) {
		f.extensions = tlv(0x0010, "\x05\xc0\x00\x02\x07\xc3\x50")
	}},
	{"reject-bad-extension-client-identity-short", ReasonBadExtension, false, func(f *rawFrame) {
		f.extensions = tlv(0x0010, "\x06\xc0\x00\x02\x07\xc3\x50")
	}},
	{"reject-bad-extension-client-identity-address", ReasonBadExtension, false, func(f *rawFrame) {
		f.extensions = tlv(0x0010, "\x04\x00\x00\x00\x00\xc3\x50")
	}},
	{"reject-bad-extension-client-identity-port", ReasonBadExtension, false, func(f *rawFrame) {
		f.extensions = tlv(0x0010, "\x04\xc0\x00\x02\x07\x00\x00")
	}},
	{"reject-bad-extension-client-identity-control", ReasonBadExtension, false, func(f *rawFrame) {
		f.extensions = tlv(0x0010, "\x04\xc0\x00\x02\x07\xc3\x50alice\nadmin")
	}},
	{"reject-bad-extension-client-identity-c1", ReasonBadExtension, false, func(f *rawFrame) {
		f.extensions = tlv(0x0010, "\x04\xc0\x00\x02\x07\xc3\x50alice\u0085admin") // NEL
	}},
	{"reject-bad-extension-client-identity-line-separator", ReasonBadExtension, false, func(f *rawFrame) {
		f.extensions = tlv(0x0010, "\x04\xc0\x00\x02\x07\xc3\x50alice\u2028admin")
	}},
	{"reject-bad-extension-client-identity-bidi-override", ReasonBadExtension, false, func(f *rawFrame) {
		f.extensions = tlv(0x0010, "\x04\xc0\x00\x02\x07\xc3\x50alice\u202enimda") // RLO: shown as "alice" + "admin"
	}},
	{"reject-bad-extension-client-identity-bidi-isolate", ReasonBadExtension, false, func(f *rawFrame) {
		f.extensions = tlv(0x0010, "\x04\xc0\x00\x02\x07\xc3\x50alice\u2066admin\u2069") // LRI ... PDI
	}},
	{"reject-bad-extension-client-identity-bidi-mark", ReasonBadExtension, false, func(f *rawFrame) {
		f.extensions = tlv(0x0010, "\x04\xc0\x00\x02\x07\xc3\x50alice\u200f") // RLM
	}},
	{"reject-bad-extension-client-identity-overlong", ReasonBadExtension, false, func(f *rawFrame) {
		f.extensions = tlv(0x0010, "\x04\xc0\x00\x02\x07\xc3\x50alice\xc0\xafadmin") // "/" in two bytes
	}},
	{"reject-bad-extension-client-identity-surrogate", ReasonBadExtension, false, func(f *rawFrame) {
		f.extensions = tlv(0x0010, "\x04\xc0\x00\x02\x07\xc3\x50alice\xed\xa0\x80") // U+D800 encoded
	}},
	{"reject-bad-extension-client-identity-nat64-u-octet", ReasonBadExtension, false, func(f *rawFrame) {
		f.extensions = tlv(0x0010, "\x06\x00\x64\xff\x9b\x00\x01\x00\x00\xff\x00\x00\x00\xc0\x00\x02\x07\xc3\x50")
	}},
	{"reject-bad-extension-client-identity-long", ReasonBadExtension, false, func(f *rawFrame) {
		f.extensions = tlv(0x0010, "\x04\xc0\x00\x02\x07\xc3\x50"+strings.Repeat("u", 256))
	}},
	{"reject-unknown-critical-extension", ReasonUnknownCriticalExtension, false, func(f *rawFrame) {
		f.extensions = tlv(0x8001, "must-understand")
	}},
	{"reject-unknown-key", ReasonUnknownKey, false, func(f *rawFrame) { f.keyID = "example-9" }},
	{"reject-bad-signature", ReasonBadSignature, false, func(f *rawFrame) { f.flipSig = true }},
	{"reject-not-yet-valid", ReasonNotYetValid, false, func(f *rawFrame) { f.iat, f.exp = exampleIssued+100, exampleIssued+130 }},
	{"reject-expired", ReasonExpired, false, func(f *rawFrame) { f.iat, f.exp = exampleIssued-200, exampleIssued-100 }},
	{"reject-ttl-too-long", ReasonTTLTooLong, false, func(f *rawFrame) { f.exp = exampleIssued + 600 }},
	{"reject-binding-mismatch", ReasonBindingMismatch, false, func(f *rawFrame) { f.binding = bytes.Repeat([]byte{0x43}, 32) }},
	{"reject-binding-required", ReasonBindingRequired, true, func(f *rawFrame) {}},
}

// goldenVerifier is the configuration the vectors are judged under; the
// connection's channel binding is exampleBinding.
func goldenVerifier(t testing.TB, requireBinding bool) *Verifier {
	t.Helper()
	v, err := NewVerifier(VerifierConfig{
		Keys:           map[string]ed25519.PublicKey{exampleKeyID: examplePub},
		MaxSkew:        30 * time.Second,
		MaxTTL:         120 * time.Second,
		RequireBinding: requireBinding,
		Now:            func() time.Time { return exampleNow },
	})
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func readGolden(t testing.TB, name string) []byte {
	t.Helper()
	text, err := os.ReadFile(filepath.Join("testdata", name+".hex"))
	if err != nil {
		t.Fatal(err)
	}
	b, err := hex.DecodeString(strings.TrimSpace(string(text)))
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return b
}

// TestGoldenVectors pins the bytes of every vector and checks the package's
// verdict on each.
func TestGoldenVectors(t *testing.T) {
	for _, gc := range goldenCases {
		t.Run(gc.name, func(t *testing.T) {
			f := exampleFrame()
			gc.build(&f)
			want := buildFrame(f)
			path := filepath.Join("testdata", gc.name+".hex")
			if *update {
				if err := os.WriteFile(path, []byte(hex.EncodeToString(want)+"\n"), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			frame := readGolden(t, gc.name)
			if !bytes.Equal(frame, want) {
				t.Fatalf("%s differs from the generator (run go test -run TestGoldenVectors -update)", path)
			}
			_, err := goldenVerifier(t, gc.requireBinding).Verify(frame, exampleBinding)
			if got := ReasonOf(err); got != string(gc.reason) {
				t.Fatalf("reason %q, want %q (err: %v)", got, gc.reason, err)
			}
		})
	}
}

// TestSignerMatchesGolden checks that the package's encoder produces the
// same bytes as the spec-derived encoder for the valid vectors.
func TestSignerMatchesGolden(t *testing.T) {
	s, err := NewSigner(exampleKeyID, exampleKey)
	if err != nil {
		t.Fatal(err)
	}
	base := Claims{
		SandboxID: "sbx-0123.example_a",
		Target:    netip.MustParseAddrPort("10.1.2.3:8080"),
		IssuedAt:  time.Unix(int64(exampleIssued), 0),
		ExpiresAt: time.Unix(int64(exampleIssued)+30, 0),
		Nonce:     [16]byte(exampleNonce),
	}
	bound := base
	bound.Target = netip.MustParseAddrPort("[fd00::1234]:443")
	bound.Binding = exampleBinding
	ext := base
	ext.Extensions = []Extension{{Type: 0x0001, Value: []byte("hello")}, {Type: 0x7fff}}
	ci4, err := ClientIdentity{Addr: netip.MustParseAddrPort("192.0.2.7:50000"), ID: "alice@example.com"}.Extension()
	if err != nil {
		t.Fatal(err)
	}
	ci6, err := ClientIdentity{Addr: netip.MustParseAddrPort("[2001:db8::1]:443")}.Extension()
	if err != nil {
		t.Fatal(err)
	}
	ciUTF8, err := ClientIdentity{Addr: netip.MustParseAddrPort("192.0.2.7:50000"), ID: "zoë 👩\u200d💻"}.Extension()
	if err != nil {
		t.Fatal(err)
	}
	id4, id6, idUTF8 := base, base, base
	id4.Extensions = []Extension{ci4}
	id6.Extensions = []Extension{{Type: 0x0001, Value: []byte("hello")}, ci6}
	idUTF8.Extensions = []Extension{ciUTF8}
	for name, c := range map[string]Claims{"valid-ipv4": base, "valid-ipv6-bound": bound, "valid-noncritical-extension": ext,
		"valid-client-identity": id4, "valid-client-identity-ipv6": id6, "valid-client-identity-utf8": idUTF8} {
		got, err := s.Sign(c)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if want := readGolden(t, name); !bytes.Equal(got, want) {
			t.Errorf("%s: Signer wrote\n%x\nwant\n%x", name, got, want)
		}
	}
}

// specVerdict is an independent implementation of docs/preamble.md, section
// "Verification", written from the spec alone: it shares no code with the
// package and runs the checks in the order of §6, steps 2 to 8 (step 1 is
// reading from a connection, step 9 needs the replay cache's state). It
// returns the claims it decoded or the reason string.
type specClaims struct {
	keyID, sandboxID string
	target           netip.AddrPort
	iat, exp         uint64
	nonce            []byte
	binding          []byte
	client           netip.AddrPort // from extension 0x0010 (§3.1)
	clientID         string
}

// specClientIdentity checks the value of extension 0x0010 by §3.1 alone.
func specClientIdentity(v []byte, c *specClaims) bool {
	if len(v) < 1 || (v[0] != 4 && v[0] != 6) {
		return false
	}
	n := 4
	if v[0] == 6 {
		n = 16
	}
	if len(v) < 1+n+2 || len(v)-(1+n+2) > 255 {
		return false
	}
	a, _ := netip.AddrFromSlice(v[1 : 1+n])
	port := uint16(v[1+n])<<8 | uint16(v[2+n])
	if port == 0 || a.IsUnspecified() || a.IsMulticast() || a == netip.AddrFrom4([4]byte{255, 255, 255, 255}) {
		return false
	}
	if v[0] == 6 && bytes.Equal(v[1:11], make([]byte, 10)) && (v[11] == 0xff && v[12] == 0xff || v[11] == 0 && v[12] == 0 && !bytes.Equal(v[13:17], []byte{0, 0, 0, 1})) {
		return false // IPv4-mapped, or IPv4-compatible other than ::1 (:: is unspecified)
	}
	if v[0] == 6 && bytes.Equal(v[1:7], []byte{0, 0x64, 0xff, 0x9b, 0, 1}) && v[9] != 0 {
		return false // 64:ff9b:1::/48 with a u octet
	}
	id := v[1+n+2:]
	if !utf8.Valid(id) {
		return false
	}
	for _, r := range string(id) {
		if r < 0x20 || r >= 0x7f && r <= 0x9f || strings.ContainsRune("\u2028\u2029\u200e\u200f\u061c\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069", r) {
			return false
		}
	}
	c.client, c.clientID = netip.AddrPortFrom(a, port), string(id)
	return true
}

func specVerdict(frame []byte, keys map[string]ed25519.PublicKey, now int64, skew, maxTTL int64, connBinding []byte, requireBinding bool) (specClaims, string) {
	var c specClaims
	if len(frame) < 8 {
		return c, "truncated"
	}
	if string(frame[:4]) != "KTLP" {
		return c, "bad-magic"
	}
	if frame[4] != 1 {
		return c, "bad-version"
	}
	if frame[5] != 0 {
		return c, "malformed"
	}
	n := int(frame[6])<<8 | int(frame[7])
	if 8+n > 1024 {
		return c, "oversized"
	}
	if n < 110 {
		return c, "malformed"
	}
	if len(frame) < 8+n {
		return c, "truncated"
	}
	if len(frame) > 8+n {
		return c, "trailing-bytes"
	}
	end := len(frame) - 64
	i := 8
	take := func(k int) []byte {
		if i+k > end {
			i = end + 1
			return nil
		}
		b := frame[i : i+k]
		i += k
		return b
	}
	var kid, sid, addr, bind, ext []byte
	var fam byte
	var port uint16
	ok := func() bool { return i <= end }
	if b := take(1); b != nil {
		kid = take(int(b[0]))
	}
	if b := take(16); b != nil {
		c.iat, c.exp = binary.BigEndian.Uint64(b), binary.BigEndian.Uint64(b[8:])
	}
	c.nonce = take(16)
	if b := take(1); b != nil {
		sid = take(int(b[0]))
	}
	if b := take(1); b != nil {
		fam = b[0]
		switch fam {
		case 4:
			addr = take(4)
		case 6:
			addr = take(16)
		default:
			if ok() {
				return c, "bad-target"
			}
		}
	}
	if b := take(2); b != nil {
		port = binary.BigEndian.Uint16(b)
	}
	if b := take(1); b != nil {
		bind = take(int(b[0]))
	}
	if b := take(2); b != nil {
		ext = take(int(binary.BigEndian.Uint16(b)))
	}
	if !ok() {
		return c, "truncated"
	}
	if i != end {
		return c, "trailing-bytes"
	}
	charset := func(b []byte, max int) bool {
		if len(b) < 1 || len(b) > max {
			return false
		}
		for _, ch := range b {
			if !strings.ContainsRune("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-", rune(ch)) {
				return false
			}
		}
		return true
	}
	if !charset(kid, 64) {
		return c, "bad-key-id"
	}
	// A sandbox ID is lowercase and starts with a letter or a digit.
	if !charset(sid, 128) || !bytes.Equal(sid, bytes.ToLower(sid)) || !strings.ContainsRune("abcdefghijklmnopqrstuvwxyz0123456789", rune(sid[0])) {
		return c, "bad-sandbox-id"
	}
	a, _ := netip.AddrFromSlice(addr)
	if port == 0 || a.IsUnspecified() || a.IsMulticast() || a.Is4In6() || a == netip.MustParseAddr("255.255.255.255") {
		return c, "bad-target"
	}
	if len(addr) == 16 && bytes.Equal(addr[:12], make([]byte, 12)) && a != netip.IPv6Loopback() {
		return c, "bad-target" // IPv4-compatible ::a.b.c.d (:: is caught above)
	}
	if len(addr) == 16 && bytes.Equal(addr[:6], []byte{0, 0x64, 0xff, 0x9b, 0, 1}) && addr[8] != 0 {
		return c, "bad-target" // 64:ff9b:1::/48 with a u octet
	}
	if len(bind) != 0 && len(bind) != 32 {
		return c, "malformed"
	}
	if c.exp <= c.iat || c.exp > 9223372035 {
		return c, "malformed"
	}
	last := -1
	for j := 0; j < len(ext); {
		if len(ext)-j < 4 {
			return c, "bad-extension"
		}
		typ := int(ext[j])<<8 | int(ext[j+1])
		l := int(ext[j+2])<<8 | int(ext[j+3])
		j += 4
		if l > len(ext)-j || typ <= last {
			return c, "bad-extension"
		}
		if typ&0x8000 != 0 {
			return c, "unknown-critical-extension"
		}
		if typ == 0x0010 && !specClientIdentity(ext[j:j+l], &c) {
			return c, "bad-extension"
		}
		last = typ
		j += l
	}
	pub, found := keys[string(kid)]
	if !found {
		return c, "unknown-key"
	}
	msg := append([]byte("caddy-ktls sandbox preamble v1\x00"), frame[:end]...)
	if !ed25519.Verify(pub, msg, frame[end:]) {
		return c, "bad-signature"
	}
	switch {
	case int64(c.iat) > now+skew:
		return c, "not-yet-valid"
	case int64(c.exp) < now-skew:
		return c, "expired"
	case int64(c.exp-c.iat) > maxTTL:
		return c, "ttl-too-long"
	}
	switch {
	case len(bind) != 0 && !bytes.Equal(bind, connBinding):
		return c, "binding-mismatch"
	case len(bind) == 0 && requireBinding:
		return c, "binding-required"
	}
	c.keyID, c.sandboxID, c.target = string(kid), string(sid), netip.AddrPortFrom(a, port)
	if len(bind) != 0 {
		c.binding = bind
	}
	return c, ""
}

// TestIndependentDecoderAgrees runs the spec-only decoder over every golden
// vector and requires the same verdict and, for valid frames, the same claims.
func TestIndependentDecoderAgrees(t *testing.T) {
	keys := map[string]ed25519.PublicKey{exampleKeyID: examplePub}
	for _, gc := range goldenCases {
		frame := readGolden(t, gc.name)
		sc, specReason := specVerdict(frame, keys, exampleNow.Unix(), 30, 120, exampleBinding, gc.requireBinding)
		c, err := goldenVerifier(t, gc.requireBinding).Verify(frame, exampleBinding)
		if specReason != ReasonOf(err) {
			t.Errorf("%s: spec decoder says %q, package says %q", gc.name, specReason, ReasonOf(err))
			continue
		}
		if err != nil {
			continue
		}
		if sc.keyID != c.KeyID || sc.sandboxID != c.SandboxID || sc.target != c.Target ||
			int64(sc.iat) != c.IssuedAt.Unix() || int64(sc.exp) != c.ExpiresAt.Unix() ||
			!bytes.Equal(sc.nonce, c.Nonce[:]) || !bytes.Equal(sc.binding, c.Binding) {
			t.Errorf("%s: spec decoder claims %+v, package claims %+v", gc.name, sc, c)
		}
		if ci, ok := c.ClientIdentity(); ci.Addr != sc.client || ci.ID != sc.clientID || ok != sc.client.IsValid() {
			t.Errorf("%s: spec decoder client %v %q, package client %v %q (%v)", gc.name, sc.client, sc.clientID, ci.Addr, ci.ID, ok)
		}
	}
}

// TestCheckOrder: a frame with two faults is rejected for the one that
// docs/preamble.md §6 checks first, by the package and by the spec-only
// decoder alike, so that every implementation names the same reason. Each
// fault is also judged alone, which proves that both are real.
func TestCheckOrder(t *testing.T) {
	type fault struct {
		reason Reason
		edit   func(f *rawFrame)
	}
	var (
		badMagic    = fault{ReasonBadMagic, func(f *rawFrame) { f.magic = "PROX" }}
		badVersion  = fault{ReasonBadVersion, func(f *rawFrame) { f.version = 2 }}
		reserved    = fault{ReasonMalformed, func(f *rawFrame) { f.reserved = 1 }}
		oversized   = fault{ReasonOversized, func(f *rawFrame) { f.extensions = tlv(0x0001, strings.Repeat("x", 900)) }}
		cut         = fault{ReasonTruncated, func(f *rawFrame) { f.cut = 10 }}
		sidOverrun  = fault{ReasonTruncated, func(f *rawFrame) { f.sidLen = 255 }}
		family      = fault{ReasonBadTarget, func(f *rawFrame) { f.family = 5 }}
		gap         = fault{ReasonTrailingBytes, func(f *rawFrame) { f.gap = []byte{0} }}
		keyID       = fault{ReasonBadKeyID, func(f *rawFrame) { f.keyID = "example 1" }}
		sandboxID   = fault{ReasonBadSandboxID, func(f *rawFrame) { f.sandboxID = "sbx/../etc" }}
		port0       = fault{ReasonBadTarget, func(f *rawFrame) { f.port = 0 }}
		bindingLen  = fault{ReasonMalformed, func(f *rawFrame) { f.binding = []byte{1, 2, 3, 4, 5} }}
		window      = fault{ReasonMalformed, func(f *rawFrame) { f.exp = f.iat }}
		extOrder    = fault{ReasonBadExtension, func(f *rawFrame) { f.extensions = append(tlv(0x0002, ""), tlv(0x0001, "")...) }}
		critical    = fault{ReasonUnknownCriticalExtension, func(f *rawFrame) { f.extensions = tlv(0x8001, "") }}
		unknownKey  = fault{ReasonUnknownKey, func(f *rawFrame) { f.keyID = "example-9" }}
		badSig      = fault{ReasonBadSignature, func(f *rawFrame) { f.flipSig = true }}
		notYet      = fault{ReasonNotYetValid, func(f *rawFrame) { f.iat, f.exp = f.iat+100, f.exp+100 }}
		expired     = fault{ReasonExpired, func(f *rawFrame) { f.iat, f.exp = f.iat-200, f.exp-200 }}
		ttlByExpiry = fault{ReasonTTLTooLong, func(f *rawFrame) { f.exp += 600 }}
		ttlByIssue  = fault{ReasonTTLTooLong, func(f *rawFrame) { f.iat -= 600 }}
		mismatch    = fault{ReasonBindingMismatch, func(f *rawFrame) { f.binding = bytes.Repeat([]byte{0x43}, 32) }}
	)
	keys := map[string]ed25519.PublicKey{exampleKeyID: examplePub}
	judge := func(t *testing.T, want Reason, faults ...fault) {
		t.Helper()
		f := exampleFrame()
		for _, x := range faults {
			x.edit(&f)
		}
		frame := buildFrame(f)
		_, err := goldenVerifier(t, false).Verify(frame, exampleBinding)
		_, spec := specVerdict(frame, keys, exampleNow.Unix(), 30, 120, exampleBinding, false)
		if ReasonOf(err) != string(want) || spec != string(want) {
			t.Errorf("%d fault(s): package says %q, spec decoder %q, want %q (err: %v)", len(faults), ReasonOf(err), spec, want, err)
		}
	}
	for _, tc := range []struct {
		name          string
		first, second fault
	}{
		{"magic-before-version", badMagic, badVersion},
		{"reserved-before-cap", reserved, oversized},
		{"cap-before-frame-length", oversized, cut},
		{"frame-length-before-fields", cut, family},
		{"field-overrun-before-family", sidOverrun, family},
		{"family-before-trailing-bytes", family, gap},
		{"family-before-key-id", family, keyID},
		{"trailing-bytes-before-key-id", gap, keyID},
		{"key-id-before-sandbox-id", keyID, sandboxID},
		{"sandbox-id-before-target", sandboxID, port0},
		{"target-before-binding-length", port0, bindingLen},
		{"target-before-window", port0, window},
		{"binding-length-before-extensions", bindingLen, extOrder},
		{"window-before-extensions", window, critical},
		{"extensions-before-key-lookup", critical, unknownKey},
		{"key-lookup-before-signature", unknownKey, badSig},
		{"signature-before-time", badSig, expired},
		{"not-yet-valid-before-ttl", notYet, ttlByExpiry},
		{"expired-before-ttl", expired, ttlByIssue},
		{"time-before-binding", ttlByExpiry, mismatch},
	} {
		t.Run(tc.name, func(t *testing.T) {
			judge(t, tc.first.reason, tc.first)
			judge(t, tc.second.reason, tc.second)
			judge(t, tc.first.reason, tc.first, tc.second)
		})
	}
	// A length prefix is part of the layout before its value is a field
	// rule (§2.2, §6 steps 4 and 5): a length that runs past the signature
	// is truncated, one that leaves bytes before it is trailing-bytes, and
	// only a length that fits is judged by its field's rule (bad-key-id,
	// malformed, bad-extension). Each layout case is paired with the same
	// rule broken by a frame whose layout holds.
	for _, tc := range []struct {
		name string
		want Reason
		edit func(f *rawFrame)
	}{
		{"key-id-length-overrun-is-truncated", ReasonTruncated, func(f *rawFrame) { f.kidLen = 200 }},
		{"key-id-too-long-but-fitting-is-bad-key-id", ReasonBadKeyID, func(f *rawFrame) { f.keyID = strings.Repeat("k", 65) }},
		// §2.2's example: the same length 200 in a 427-byte frame fits, so
		// the walk reads on and meets family 0x78 ("x").
		{"key-id-length-200-that-fits-is-read-on", ReasonBadTarget, func(f *rawFrame) {
			f.kidLen, f.extensions = 200, tlv(0x0001, strings.Repeat("x", 280))
		}},
		{"key-id-length-200-one-byte-short-is-truncated", ReasonTruncated, func(f *rawFrame) {
			f.kidLen, f.extensions = 200, tlv(0x0001, strings.Repeat("x", 279))
		}},
		{"binding-length-overrun-is-truncated", ReasonTruncated, func(f *rawFrame) { f.bindLen = 200 }},
		{"binding-length-short-of-its-bytes-is-trailing-bytes", ReasonTrailingBytes, func(f *rawFrame) {
			f.binding, f.bindLen = make([]byte, 32), 3 // ext_length reads 0 from the binding, 29+2 bytes remain
		}},
		{"binding-length-5-fitting-is-malformed", ReasonMalformed, func(f *rawFrame) { f.binding = []byte{1, 2, 3, 4, 5} }},
		{"ext-length-overrun-is-truncated", ReasonTruncated, func(f *rawFrame) { f.extensions, f.extLen = tlv(0x0001, "hello"), 200 }},
		{"ext-length-cutting-a-tlv-is-trailing-bytes", ReasonTrailingBytes, func(f *rawFrame) { f.extensions, f.extLen = tlv(0x0001, "hello"), 4 }},
		{"tlv-overrun-inside-the-area-is-bad-extension", ReasonBadExtension, func(f *rawFrame) { f.extensions = tlv(0x0001, "hello")[:6] }},
		{"body-length-below-minimum-is-malformed-before-trailing-bytes", ReasonMalformed, func(f *rawFrame) { f.lenDelta = -100 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			judge(t, tc.want, fault{edit: tc.edit})
		})
	}

	// Inside the extension area the first faulty TLV decides.
	t.Run("critical-tlv-before-misordered-tlv", func(t *testing.T) {
		judge(t, ReasonUnknownCriticalExtension, fault{edit: func(f *rawFrame) {
			f.extensions = append(tlv(0x8001, ""), tlv(0x0001, "")...)
		}})
	})
	t.Run("misordered-tlv-before-critical-tlv", func(t *testing.T) {
		judge(t, ReasonBadExtension, fault{edit: func(f *rawFrame) {
			f.extensions = append(append(tlv(0x0002, ""), tlv(0x0001, "")...), tlv(0x8001, "")...)
		}})
	})
}

// TestWorkedExampleMatchesVector checks that the frame docs/preamble.md §8
// spells out, field by field, is the bytes of testdata/valid-ipv4.hex.
func TestWorkedExampleMatchesVector(t *testing.T) {
	section := specSection(t, 8)
	_, block, ok := strings.Cut(section, "`preamble/testdata/valid-ipv4.hex`):\n\n")
	if !ok {
		t.Fatal("docs/preamble.md §8 does not introduce the frame of valid-ipv4.hex")
	}
	block, _, _ = strings.Cut(block, "\n\n")
	var text strings.Builder
	for line := range strings.Lines(block) {
		// Each line is indented hex, then, after two spaces or more, a comment.
		fields := regexp.MustCompile(`\s{2,}`).Split(strings.TrimSpace(line), 2)
		text.WriteString(strings.ReplaceAll(fields[0], " ", ""))
	}
	doc, err := hex.DecodeString(text.String())
	if err != nil {
		t.Fatalf("§8's frame is not hex: %v", err)
	}
	if want := readGolden(t, "valid-ipv4"); !bytes.Equal(doc, want) {
		t.Errorf("docs/preamble.md §8 spells out\n%x\nvalid-ipv4.hex holds\n%x", doc, want)
	}
}

// TestExtensionVectorsFromSpec rebuilds, byte for byte, every vector of the
// table in docs/preamble.md §8 that gives a vector's extension area (the
// client identity vectors among them) from the worked example and that area
// alone, checks the verdict the table states, and requires the table to
// hold every client identity vector: an implementer can rebuild each from
// the spec.
func TestExtensionVectorsFromSpec(t *testing.T) {
	row := regexp.MustCompile("^\\| `([a-z0-9-]+)` \\| `([0-9a-f× ]+)` \\| [^|]+ \\| ([^|]+) \\|$")
	repeat := regexp.MustCompile(`^([0-9a-f]{2})×([0-9]+)$`)
	reasons := map[string]Reason{}
	for _, gc := range goldenCases {
		reasons[gc.name] = gc.reason
	}
	seen := map[string]bool{}
	for line := range strings.Lines(specSection(t, 8)) {
		m := row.FindStringSubmatch(strings.TrimSpace(line))
		if m == nil {
			continue
		}
		name, verdict := m[1], strings.TrimSpace(m[3])
		var area []byte
		for _, tok := range strings.Fields(m[2]) {
			if r := repeat.FindStringSubmatch(tok); r != nil {
				b, _ := hex.DecodeString(r[1])
				n, _ := strconv.Atoi(r[2])
				area = append(area, bytes.Repeat(b, n)...)
				continue
			}
			b, err := hex.DecodeString(tok)
			if err != nil {
				t.Fatalf("§8 row %s: %q is not hex", name, tok)
			}
			area = append(area, b...)
		}
		want, known := reasons[name]
		if !known || seen[name] {
			t.Errorf("§8 row %s: no such vector, or listed twice", name)
			continue
		}
		seen[name] = true
		if wantVerdict := "`" + string(want) + "`"; want == "" && verdict != "valid" || want != "" && verdict != wantVerdict {
			t.Errorf("§8 row %s: verdict %q, the vector's is %q", name, verdict, want)
		}
		f := exampleFrame()
		f.extensions = area
		if got := buildFrame(f); !bytes.Equal(got, readGolden(t, name)) {
			t.Errorf("§8 row %s: the worked example with extension area %x is\n%x\nthe vector holds\n%x", name, area, got, readGolden(t, name))
		}
	}
	for _, gc := range goldenCases {
		if strings.Contains(gc.name, "client-identity") && !seen[gc.name] {
			t.Errorf("§8 gives no extension area for %s", gc.name)
		}
	}
	if len(seen) == 0 {
		t.Fatal("§8 has no extension-area table")
	}
}
