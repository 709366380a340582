package preamble

import (
	"encoding/binary"
	"net/netip"
	"unicode/utf8"
)

// Extension types assigned by docs/preamble.md §3.1.
const (
	// ExtClientIdentity (0x0010, non-critical) carries the end user's
	// address and port as the gateway saw them and, optionally, an opaque
	// identity string (ClientIdentity). 0x0001 and 0x0002 stay unassigned:
	// the test vectors use them as unknown types.
	ExtClientIdentity uint16 = 0x0010
	// MaxClientIDLen caps the identity string of ExtClientIdentity.
	MaxClientIDLen = 255
)

// ClientIdentity is the value of extension ExtClientIdentity: who the gateway
// is connecting on behalf of. Layout: family (u8, 4 or 6), address (4 or 16
// bytes), port (u16), then the identity string, the rest of the value (0..255
// bytes of well-formed UTF-8 without control, line-separator or
// bidirectional formatting characters; empty when there is none).
type ClientIdentity struct {
	// Addr is the end user's address and port. Its address and port follow
	// the target rules (CheckTarget): a unicast host without zone, IPv4 as
	// IPv4, port 1..65535.
	Addr netip.AddrPort
	// ID is an opaque identity string (e.g. an authenticated user name), or
	// "" for none.
	ID string
}

// Check returns the *Error (ReasonBadExtension) a frame carrying ci would be
// refused with, or nil.
func (ci ClientIdentity) Check() error {
	if err := CheckTarget(ci.Addr); err != nil {
		return refuse(ReasonBadExtension, "client identity %#04x: address: %s", ExtClientIdentity, err.(*Error).Detail)
	}
	return checkClientID(ci.ID)
}

func checkClientID(id string) error {
	if len(id) > MaxClientIDLen {
		return refuse(ReasonBadExtension, "client identity %#04x: identity of %d bytes, at most %d", ExtClientIdentity, len(id), MaxClientIDLen)
	}
	if !utf8.ValidString(id) {
		return refuse(ReasonBadExtension, "client identity %#04x: identity %q is not well-formed UTF-8", ExtClientIdentity, id)
	}
	for _, r := range id {
		if class := refusedIdentityRune(r); class != "" {
			return refuse(ReasonBadExtension, "client identity %#04x: identity %q holds %s %U", ExtClientIdentity, id, class, r)
		}
	}
	return nil
}

// refusedIdentityRune names the class of r when an identity string may not
// hold it (docs/preamble.md §3.1), or returns "": the C0 and C1 controls
// (U+0000-U+001F, U+007F-U+009F); the line and paragraph separators
// U+2028 and U+2029, which end a line as a newline does; and the
// bidirectional formatting characters, which reorder the text shown around
// them (a log line or a user list could then display another name than the
// bytes hold): the marks U+200E, U+200F and U+061C, the embeddings and
// overrides U+202A-U+202E, and the isolates U+2066-U+2069. Other format
// characters (U+200B-U+200D, U+FEFF, U+00AD, tag characters) neither
// break lines nor reorder text, and pass: names and emoji sequences use
// some of them.
func refusedIdentityRune(r rune) string {
	switch {
	case r < 0x20 || (r >= 0x7f && r <= 0x9f):
		return "control character"
	case r == 0x2028 || r == 0x2029:
		return "line or paragraph separator"
	case r == 0x200e || r == 0x200f || r == 0x061c || (0x202a <= r && r <= 0x202e) || (0x2066 <= r && r <= 0x2069):
		return "bidirectional formatting character"
	}
	return ""
}

// Extension encodes ci as an ExtClientIdentity TLV for Claims.Extensions, or
// returns the *Error (ReasonBadExtension) ci breaks.
func (ci ClientIdentity) Extension() (Extension, error) {
	if err := ci.Check(); err != nil {
		return Extension{}, err
	}
	a := ci.Addr.Addr()
	v := make([]byte, 0, 1+16+2+len(ci.ID))
	if a.Is4() {
		v = append(v, familyIPv4)
	} else {
		v = append(v, familyIPv6)
	}
	v = append(v, a.AsSlice()...)
	v = binary.BigEndian.AppendUint16(v, ci.Addr.Port())
	v = append(v, ci.ID...)
	return Extension{Type: ExtClientIdentity, Value: v}, nil
}

// ParseClientIdentity decodes the value of an ExtClientIdentity TLV, or
// returns the *Error (ReasonBadExtension) saying what is wrong with it.
func ParseClientIdentity(v []byte) (ClientIdentity, error) {
	if len(v) < 1 {
		return ClientIdentity{}, refuse(ReasonBadExtension, "client identity %#04x: empty value", ExtClientIdentity)
	}
	var alen int
	switch v[0] {
	case familyIPv4:
		alen = 4
	case familyIPv6:
		alen = 16
	default:
		return ClientIdentity{}, refuse(ReasonBadExtension, "client identity %#04x: address family %d, want 4 or 6", ExtClientIdentity, v[0])
	}
	if len(v) < 1+alen+2 {
		return ClientIdentity{}, refuse(ReasonBadExtension, "client identity %#04x: value of %d bytes, family %d needs at least %d", ExtClientIdentity, len(v), v[0], 1+alen+2)
	}
	a, _ := netip.AddrFromSlice(v[1 : 1+alen])
	ci := ClientIdentity{
		Addr: netip.AddrPortFrom(a, binary.BigEndian.Uint16(v[1+alen:])),
		ID:   string(v[1+alen+2:]),
	}
	if err := ci.Check(); err != nil {
		return ClientIdentity{}, err
	}
	return ci, nil
}

// ClientIdentity returns the frame's ExtClientIdentity, if it carries one.
// Claims from Verify hold only a well-formed one (a malformed one rejects the
// frame with ReasonBadExtension).
func (c *Claims) ClientIdentity() (ClientIdentity, bool) {
	for _, e := range c.Extensions {
		if e.Type == ExtClientIdentity {
			ci, err := ParseClientIdentity(e.Value)
			return ci, err == nil
		}
	}
	return ClientIdentity{}, false
}

// checkKnownExtension applies the value rules of the extension types this
// version understands (section 3.1); unknown non-critical types pass.
func checkKnownExtension(typ uint16, v []byte) error {
	if typ == ExtClientIdentity {
		_, err := ParseClientIdentity(v)
		return err
	}
	return nil
}
