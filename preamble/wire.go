package preamble

import (
	"encoding/binary"
	"errors"
	"io"
	"math"
	"net"
	"net/netip"
	"time"
	"unsafe"
)

// Wire constants of format version 1. docs/preamble.md is the normative
// description; these values must stay in step with it.
const (
	// Magic opens every frame: ASCII "KTLP".
	Magic = "KTLP"
	// Version is the only frame version this package writes and accepts.
	Version = 1
	// HeaderLen is the fixed header: magic (4), version (1), reserved (1),
	// body length (2, big endian).
	HeaderLen = 8
	// MaxFrameLen is the hard cap on a whole frame (header + body). A
	// verifier may be configured lower, never higher.
	MaxFrameLen = 1024
	// NonceLen is the size of the per-frame random nonce.
	NonceLen = 16
	// BindingLen is the size of a channel binding (TLS exporter output).
	BindingLen = 32
	// SignatureLen is the size of the Ed25519 signature that ends the body.
	SignatureLen = 64
	// MaxKeyIDLen and MaxSandboxIDLen cap the two identifiers.
	MaxKeyIDLen     = 64
	MaxSandboxIDLen = 128
	// CriticalBit marks an extension type that a verifier must understand:
	// an unknown critical extension rejects the frame, an unknown
	// non-critical one is ignored.
	CriticalBit = 0x8000

	// SignatureContext is prepended to the signed bytes (header and body up
	// to the signature) so that a signature over a preamble can never be
	// mistaken for an Ed25519 signature over anything else made with the same
	// key. It ends in a NUL byte.
	SignatureContext = "caddy-ktls sandbox preamble v1\x00"

	// ChannelBindingLabel is the TLS exporter label of the channel binding
	// (RFC 9266, tls-exporter), with an empty context and 32 bytes of output.
	ChannelBindingLabel = "EXPORTER-Channel-Binding"

	familyIPv4 = 4
	familyIPv6 = 6

	// minBodyLen is the smallest body that can hold every fixed field:
	// one-byte key ID and sandbox ID, IPv4 target, no binding, no extensions.
	minBodyLen = 1 + 1 + 8 + 8 + NonceLen + 1 + 1 + 1 + 4 + 2 + 1 + 2 + SignatureLen
)

// Claims is what a preamble asserts. Sign encodes it; Verify returns it.
type Claims struct {
	// KeyID names the signing key in the verifier's keyring. Sign fills it
	// from the Signer.
	KeyID string
	// SandboxID names the sandbox: 1..128 bytes of [a-z0-9._-], the first
	// a letter or a digit (CheckSandboxID). Sandbox IDs are
	// case-insensitive and a frame carries the lowercase form:
	// CanonicalSandboxID turns an ID from outside into it.
	SandboxID string
	// Target is the private IPv4 or IPv6 address and port of the sandbox
	// service. Never a host name: the forwarder does no DNS.
	Target netip.AddrPort
	// IssuedAt and ExpiresAt bound the frame's validity (second precision).
	// Sign defaults IssuedAt to now and ExpiresAt to IssuedAt + DefaultTTL.
	IssuedAt, ExpiresAt time.Time
	// Nonce makes each frame unique for the replay cache. Sign fills an
	// all-zero nonce from crypto/rand.
	Nonce [NonceLen]byte
	// Binding is the channel binding of the gateway↔forwarder TLS session
	// (ChannelBinding), or nil for an unbound frame.
	Binding []byte
	// Extensions are optional TLVs, encoded in strictly ascending Type order.
	Extensions []Extension
}

// Extension is one optional TLV. A Type with CriticalBit set must be
// understood by the verifier.
type Extension struct {
	Type  uint16
	Value []byte
}

// Critical reports whether a verifier that does not know this extension must
// reject the frame.
func (e Extension) Critical() bool { return e.Type&CriticalBit != 0 }

// ReadFrame reads exactly one frame from r: the fixed header, then exactly
// the body length it declares, and never a byte more, because the bytes after
// the frame belong to the tenant and must stay in the kernel socket for
// splice. maxLen caps the whole frame (header included); zero or a value above
// MaxFrameLen means MaxFrameLen. The caller bounds the wait with a read
// deadline. The returned slice holds the whole frame, ready for Verify.
func ReadFrame(r io.Reader, maxLen int) ([]byte, error) {
	if maxLen <= 0 || maxLen > MaxFrameLen {
		maxLen = MaxFrameLen
	}
	var hdr [HeaderLen]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, readError(err, "header")
	}
	bodyLen, err := checkHeader(hdr[:], maxLen)
	if err != nil {
		return nil, err
	}
	frame := make([]byte, HeaderLen+bodyLen)
	copy(frame, hdr[:])
	if _, err := io.ReadFull(r, frame[HeaderLen:]); err != nil {
		return nil, readError(err, "body")
	}
	return frame, nil
}

func readError(err error, part string) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return &Error{Reason: ReasonTruncated, Detail: "stream ended inside the frame " + part, Err: err}
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return &Error{Reason: ReasonTimeout, Detail: "deadline reached reading the frame " + part, Err: err}
	}
	return &Error{Reason: ReasonReadFailed, Detail: "reading the frame " + part, Err: err}
}

// checkHeader validates the fixed header and returns the body length.
func checkHeader(hdr []byte, maxLen int) (int, error) {
	if string(hdr[0:4]) != Magic {
		return 0, refuse(ReasonBadMagic, "frame starts with %q, want %q", hdr[0:4], Magic)
	}
	if hdr[4] != Version {
		return 0, refuse(ReasonBadVersion, "version %d, want %d", hdr[4], Version)
	}
	if hdr[5] != 0 {
		return 0, refuse(ReasonMalformed, "reserved header byte is %#x, want 0", hdr[5])
	}
	bodyLen := int(binary.BigEndian.Uint16(hdr[6:8]))
	if HeaderLen+bodyLen > maxLen {
		return 0, refuse(ReasonOversized, "frame of %d bytes exceeds the cap of %d", HeaderLen+bodyLen, maxLen)
	}
	if bodyLen < minBodyLen {
		return 0, refuse(ReasonMalformed, "body of %d bytes is shorter than the minimum %d", bodyLen, minBodyLen)
	}
	return bodyLen, nil
}

// parsed is a structurally valid frame, before any cryptographic or policy
// check. Its byte slices alias the frame.
type parsed struct {
	keyID     []byte
	claims    Claims
	signed    []byte // header + body up to the signature
	signature []byte
}

// parse checks the structure of a whole frame (header included) against the
// wire rules. It does not allocate on frames without extensions: the
// SandboxID string aliases the frame (see Verify).
func parse(frame []byte, maxLen int) (parsed, error) {
	var p parsed
	if len(frame) < HeaderLen {
		return p, refuse(ReasonTruncated, "frame of %d bytes is shorter than the header", len(frame))
	}
	bodyLen, err := checkHeader(frame[:HeaderLen], maxLen)
	if err != nil {
		return p, err
	}
	if len(frame) < HeaderLen+bodyLen {
		return p, refuse(ReasonTruncated, "frame holds %d bytes, header declares %d", len(frame), HeaderLen+bodyLen)
	}
	if len(frame) > HeaderLen+bodyLen {
		return p, refuse(ReasonTrailingBytes, "%d bytes follow the declared frame", len(frame)-HeaderLen-bodyLen)
	}
	sigStart := len(frame) - SignatureLen
	d := decoder{buf: frame[:sigStart], off: HeaderLen}

	kidLen := int(d.u8())
	p.keyID = d.bytes(kidLen)
	iat := d.u64()
	exp := d.u64()
	copy(p.claims.Nonce[:], d.bytes(NonceLen))
	sidLen := int(d.u8())
	sid := d.bytes(sidLen)
	family := d.u8()
	var addr netip.Addr
	switch family {
	case familyIPv4:
		addr = netip.AddrFrom4([4]byte(d.bytes(4)))
	case familyIPv6:
		addr = netip.AddrFrom16([16]byte(d.bytes(16)))
	default:
		if !d.short {
			return p, refuse(ReasonBadTarget, "address family %d, want 4 or 6", family)
		}
	}
	port := d.u16()
	bindLen := int(d.u8())
	binding := d.bytes(bindLen)
	extLen := int(d.u16())
	ext := d.bytes(extLen)
	if d.short {
		return p, refuse(ReasonTruncated, "fields run past the signature at offset %d", d.off)
	}
	if d.off != sigStart {
		return p, refuse(ReasonTrailingBytes, "%d bytes between the extensions and the signature", sigStart-d.off)
	}

	if kidLen == 0 || kidLen > MaxKeyIDLen || !validID(p.keyID) {
		return p, refuse(ReasonBadKeyID, "key ID %q: want 1..%d bytes of [A-Za-z0-9._-]", p.keyID, MaxKeyIDLen)
	}
	if err := checkSandboxID(sid); err != nil {
		return p, err
	}
	target := netip.AddrPortFrom(addr, port)
	if err := CheckTarget(target); err != nil {
		return p, err
	}
	if bindLen != 0 && bindLen != BindingLen {
		return p, refuse(ReasonMalformed, "channel binding of %d bytes, want 0 or %d", bindLen, BindingLen)
	}
	if exp <= iat || exp > uint64(maxUnixSeconds) {
		return p, refuse(ReasonMalformed, "validity window [%d, %d] is empty or out of range", iat, exp)
	}
	exts, err := parseExtensions(ext)
	if err != nil {
		return p, err
	}

	p.claims.SandboxID = unsafe.String(unsafe.SliceData(sid), len(sid))
	p.claims.Target = target
	p.claims.IssuedAt = time.Unix(int64(iat), 0)
	p.claims.ExpiresAt = time.Unix(int64(exp), 0)
	if bindLen != 0 {
		p.claims.Binding = binding
	}
	p.claims.Extensions = exts
	p.signed = frame[:sigStart]
	p.signature = frame[sigStart:]
	return p, nil
}

// maxUnixSeconds keeps timestamps inside what time.Unix and int64
// arithmetic on durations handle without overflow (year 2262).
const maxUnixSeconds = math.MaxInt64/int64(time.Second) - 1

// parseExtensions walks the TLV area. Types must be strictly ascending (which
// also forbids duplicates) so that every claim set has one encoding. Critical
// extensions are all unknown in version 1; a known non-critical one
// (ExtClientIdentity) must hold a well-formed value.
func parseExtensions(area []byte) ([]Extension, error) {
	var exts []Extension
	prev := -1
	for off := 0; off < len(area); {
		if len(area)-off < 4 {
			return nil, refuse(ReasonBadExtension, "extension header truncated at offset %d", off)
		}
		typ := binary.BigEndian.Uint16(area[off:])
		n := int(binary.BigEndian.Uint16(area[off+2:]))
		off += 4
		if n > len(area)-off {
			return nil, refuse(ReasonBadExtension, "extension %#04x declares %d bytes, %d remain", typ, n, len(area)-off)
		}
		if int(typ) <= prev {
			return nil, refuse(ReasonBadExtension, "extension %#04x after %#04x: types must be strictly ascending", typ, prev)
		}
		prev = int(typ)
		if typ&CriticalBit != 0 {
			return nil, refuse(ReasonUnknownCriticalExtension, "critical extension %#04x is not understood", typ)
		}
		if err := checkKnownExtension(typ, area[off:off+n]); err != nil {
			return nil, err
		}
		exts = append(exts, Extension{Type: typ, Value: area[off : off+n : off+n]})
		off += n
	}
	return exts, nil
}

// CheckTarget returns the *Error (ReasonBadTarget) a frame naming target t
// would be refused with, or nil when t can be a target: a unicast address
// without zone, IPv4 as IPv4 (not IPv4-mapped or IPv4-compatible), not a
// malformed NAT64 address (64:ff9b:1::/48 with a non-zero u octet), and a
// port.
func CheckTarget(t netip.AddrPort) error {
	a := t.Addr()
	switch {
	case !a.IsValid():
		return refuse(ReasonBadTarget, "no address")
	case a.Zone() != "":
		return refuse(ReasonBadTarget, "address %s has a zone", a)
	case a.Is4In6():
		return refuse(ReasonBadTarget, "IPv4-mapped address %s: encode it as IPv4", a)
	case a.IsUnspecified(), a.IsMulticast(), a == netip.AddrFrom4([4]byte{255, 255, 255, 255}):
		return refuse(ReasonBadTarget, "address %s is not a unicast host", a)
	case isIPv4Compatible(a):
		return refuse(ReasonBadTarget, "IPv4-compatible address %s (deprecated ::/96): encode it as IPv4", a)
	case nat64UOctetSet(a):
		return refuse(ReasonBadTarget, "address %s in the NAT64 local-use prefix 64:ff9b:1::/48 has bits 64-71 (the RFC 6052 u octet) set", a)
	case t.Port() == 0:
		return refuse(ReasonBadTarget, "port 0")
	}
	return nil
}

// isIPv4Compatible reports whether a is a deprecated IPv4-compatible IPv6
// address, ::a.b.c.d (RFC 4291 §2.5.5.1): in ::/96 but neither :: nor ::1.
// Like an IPv4-mapped address it would be a second encoding of an IPv4
// target, one that a target policy written for IPv4 would not recognize.
func isIPv4Compatible(a netip.Addr) bool {
	if !a.Is6() || a.Is4In6() || a.IsUnspecified() || a.IsLoopback() {
		return false
	}
	b := a.As16()
	return [12]byte(b[:12]) == [12]byte{}
}

// nat64LocalUse is the local-use NAT64 prefix of RFC 8215, inside which
// the operator's translator prefix (RFC 6052, /48 to /96) lies.
var nat64LocalUse = netip.MustParsePrefix("64:ff9b:1::/48")

// nat64UOctetSet reports whether a lies in 64:ff9b:1::/48 with bits 64-71,
// the "u" octet, not zero. RFC 6052 §2.2 requires that octet to be zero in
// every translated address, whatever the prefix length (a /96 prefix must
// hold a zero there), so such an address is no valid NAT64 address. The
// well-known 64:ff9b::/96 has a zero there by construction.
func nat64UOctetSet(a netip.Addr) bool {
	return a.Is6() && nat64LocalUse.Contains(a) && a.As16()[8] != 0
}

// validID reports whether b is made only of [A-Za-z0-9._-], the key ID
// charset.
func validID(b []byte) bool {
	for _, c := range b {
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9', c == '.', c == '_', c == '-':
		default:
			return false
		}
	}
	return true
}

// decoder reads big-endian fields; running past the end sets short instead
// of panicking so that the caller reports one truncation error.
type decoder struct {
	buf   []byte
	off   int
	short bool
}

func (d *decoder) bytes(n int) []byte {
	if d.short || n > len(d.buf)-d.off {
		d.short = true
		return make([]byte, n)
	}
	b := d.buf[d.off : d.off+n : d.off+n]
	d.off += n
	return b
}

func (d *decoder) u8() uint8   { return d.bytes(1)[0] }
func (d *decoder) u16() uint16 { return binary.BigEndian.Uint16(d.bytes(2)) }
func (d *decoder) u64() uint64 { return binary.BigEndian.Uint64(d.bytes(8)) }

// CheckSandboxID returns the *Error (ReasonBadSandboxID) a frame naming
// sandbox id would be refused with, or nil when id is a sandbox ID in its
// canonical form: 1..128 bytes of [a-z0-9._-] that start with [a-z0-9].
// An ID with an uppercase letter is refused: sandbox IDs are
// case-insensitive and a frame carries only the lowercase form, so each
// sandbox has one encoding. Where an ID comes from outside (a server name,
// a Host header, a request, an admin call), CanonicalSandboxID lowercases
// and checks it.
func CheckSandboxID(id string) error {
	return checkSandboxID(unsafe.Slice(unsafe.StringData(id), len(id)))
}

func checkSandboxID(b []byte) error {
	switch {
	case len(b) == 0 || len(b) > MaxSandboxIDLen:
		return refuse(ReasonBadSandboxID, "sandbox ID %q is %d bytes: want 1..%d bytes of [a-z0-9._-]", b, len(b), MaxSandboxIDLen)
	case !validSandboxID(b):
		if hasUpper(b) && validSandboxID(asciiLower(b)) {
			return refuse(ReasonBadSandboxID, "sandbox ID %q has uppercase letters: sandbox IDs are case-insensitive and travel lowercase (%q)", b, asciiLower(b))
		}
		return refuse(ReasonBadSandboxID, "sandbox ID %q: want 1..%d bytes of [a-z0-9._-], the first a letter or a digit", b, MaxSandboxIDLen)
	}
	return nil
}

// CanonicalSandboxID returns the canonical form of a sandbox ID taken
// from outside (a TLS server name label, an HTTP Host label or header, a
// placeholder, an admin request, a command-line flag): the ASCII letters
// A-Z lowercased, nothing else changed (no Unicode case folding: the
// Kelvin sign is no "k"). Sandbox IDs are case-insensitive, like DNS
// labels, so every spelling of one sandbox shares its limits, refusals,
// activity and metrics. An ID that is not valid even lowercased is the
// *Error (ReasonBadSandboxID) CheckSandboxID gives.
func CanonicalSandboxID(id string) (string, error) {
	b := unsafe.Slice(unsafe.StringData(id), len(id))
	if !hasUpper(b) {
		if err := checkSandboxID(b); err != nil {
			return "", err
		}
		return id, nil
	}
	lower := asciiLower(b)
	if checkSandboxID(lower) != nil {
		// The error names the ID as given.
		return "", checkSandboxID(b)
	}
	return string(lower), nil
}

// validSandboxID reports whether b is a sandbox ID's canonical charset:
// [a-z0-9._-], the first byte [a-z0-9], so that no ID is a path segment
// of dots ("." or "..") or looks like an option or a hidden name.
func validSandboxID(b []byte) bool {
	if len(b) == 0 || !('a' <= b[0] && b[0] <= 'z' || '0' <= b[0] && b[0] <= '9') {
		return false
	}
	for _, c := range b[1:] {
		switch {
		case 'a' <= c && c <= 'z', '0' <= c && c <= '9', c == '.', c == '_', c == '-':
		default:
			return false
		}
	}
	return true
}

func hasUpper(b []byte) bool {
	for _, c := range b {
		if 'A' <= c && c <= 'Z' {
			return true
		}
	}
	return false
}

// asciiLower returns a copy of b with A-Z lowercased.
func asciiLower(b []byte) []byte {
	out := make([]byte, len(b))
	for i, c := range b {
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		out[i] = c
	}
	return out
}

// encode validates c and returns the frame without its signature (header
// and body up to the signature), with room for the signature appended later.
func encode(keyID string, c *Claims) ([]byte, error) {
	if len(keyID) == 0 || len(keyID) > MaxKeyIDLen || !validID([]byte(keyID)) {
		return nil, refuse(ReasonBadKeyID, "key ID %q: want 1..%d bytes of [A-Za-z0-9._-]", keyID, MaxKeyIDLen)
	}
	if err := CheckSandboxID(c.SandboxID); err != nil {
		return nil, err
	}
	if err := CheckTarget(c.Target); err != nil {
		return nil, err
	}
	if c.Binding != nil && len(c.Binding) != BindingLen {
		return nil, refuse(ReasonMalformed, "channel binding of %d bytes, want %d", len(c.Binding), BindingLen)
	}
	iat, exp := c.IssuedAt.Unix(), c.ExpiresAt.Unix()
	if iat < 0 || exp <= iat || exp > maxUnixSeconds {
		return nil, refuse(ReasonMalformed, "validity window [%d, %d] is empty or out of range", iat, exp)
	}
	extLen := 0
	prev := -1
	for _, e := range c.Extensions {
		if int(e.Type) <= prev {
			return nil, refuse(ReasonBadExtension, "extension %#04x after %#04x: types must be strictly ascending", e.Type, prev)
		}
		if len(e.Value) > 0xffff {
			return nil, refuse(ReasonBadExtension, "extension %#04x value of %d bytes", e.Type, len(e.Value))
		}
		if err := checkKnownExtension(e.Type, e.Value); err != nil {
			return nil, err
		}
		prev = int(e.Type)
		extLen += 4 + len(e.Value)
	}
	addr := c.Target.Addr()
	bodyLen := 1 + len(keyID) + 8 + 8 + NonceLen + 1 + len(c.SandboxID) + 1 + addr.BitLen()/8 + 2 +
		1 + len(c.Binding) + 2 + extLen + SignatureLen
	if HeaderLen+bodyLen > MaxFrameLen {
		return nil, refuse(ReasonOversized, "frame of %d bytes exceeds the cap of %d", HeaderLen+bodyLen, MaxFrameLen)
	}

	b := make([]byte, 0, HeaderLen+bodyLen)
	b = append(b, Magic...)
	b = append(b, Version, 0)
	b = binary.BigEndian.AppendUint16(b, uint16(bodyLen))
	b = append(b, byte(len(keyID)))
	b = append(b, keyID...)
	b = binary.BigEndian.AppendUint64(b, uint64(iat))
	b = binary.BigEndian.AppendUint64(b, uint64(exp))
	b = append(b, c.Nonce[:]...)
	b = append(b, byte(len(c.SandboxID)))
	b = append(b, c.SandboxID...)
	if addr.Is4() {
		b = append(b, familyIPv4)
	} else {
		b = append(b, familyIPv6)
	}
	b = append(b, addr.AsSlice()...)
	b = binary.BigEndian.AppendUint16(b, c.Target.Port())
	b = append(b, byte(len(c.Binding)))
	b = append(b, c.Binding...)
	b = binary.BigEndian.AppendUint16(b, uint16(extLen))
	for _, e := range c.Extensions {
		b = binary.BigEndian.AppendUint16(b, e.Type)
		b = binary.BigEndian.AppendUint16(b, uint16(len(e.Value)))
		b = append(b, e.Value...)
	}
	return b, nil
}
