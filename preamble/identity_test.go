package preamble

import (
	"bytes"
	"fmt"
	"net/netip"
	"strings"
	"testing"
)

func TestClientIdentityRoundTrip(t *testing.T) {
	for _, ci := range []ClientIdentity{
		{Addr: netip.MustParseAddrPort("192.0.2.7:50000"), ID: "alice@example.com"},
		{Addr: netip.MustParseAddrPort("[2001:db8::1]:443")},
		{Addr: netip.MustParseAddrPort("[::1]:1"), ID: strings.Repeat("é", 127)},
	} {
		e, err := ci.Extension()
		if err != nil {
			t.Fatalf("%v: %v", ci, err)
		}
		if e.Type != 0x0010 || e.Critical() {
			t.Fatalf("type %#04x", e.Type)
		}
		got, err := ParseClientIdentity(e.Value)
		if err != nil || got != ci {
			t.Fatalf("parsed %v, %v; want %v", got, err, ci)
		}
	}
	e, _ := ClientIdentity{Addr: netip.MustParseAddrPort("192.0.2.7:50000"), ID: "u"}.Extension()
	if want := []byte{4, 192, 0, 2, 7, 0xc3, 0x50, 'u'}; !bytes.Equal(e.Value, want) {
		t.Fatalf("value %x, want %x", e.Value, want)
	}
}

// TestClientIdentityRejects: every rule of docs/preamble.md §3.1, at the
// encoder (Extension, and Sign of a raw TLV) and the decoder, with its detail.
func TestClientIdentityRejects(t *testing.T) {
	signer, err := NewSigner(exampleKeyID, exampleKey)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		ci     ClientIdentity
		detail string
	}{
		{ClientIdentity{}, "address: no address"},
		{ClientIdentity{Addr: netip.MustParseAddrPort("0.0.0.0:1")}, "not a unicast host"},
		{ClientIdentity{Addr: netip.MustParseAddrPort("[::ffff:192.0.2.7]:1")}, "IPv4-mapped"},
		{ClientIdentity{Addr: netip.MustParseAddrPort("192.0.2.7:0")}, "port 0"},
		{ClientIdentity{Addr: netip.MustParseAddrPort("192.0.2.7:1"), ID: strings.Repeat("x", 256)}, "identity of 256 bytes, at most 255"},
		{ClientIdentity{Addr: netip.MustParseAddrPort("192.0.2.7:1"), ID: "a\x00b"}, "control character U+0000"},
		{ClientIdentity{Addr: netip.MustParseAddrPort("192.0.2.7:1"), ID: "a\u0085b"}, "control character U+0085"},
		{ClientIdentity{Addr: netip.MustParseAddrPort("192.0.2.7:1"), ID: "\xff"}, "is not well-formed UTF-8"},
		{ClientIdentity{Addr: netip.MustParseAddrPort("192.0.2.7:1"), ID: "a\xc0\xafb"}, "is not well-formed UTF-8"},        // overlong "/"
		{ClientIdentity{Addr: netip.MustParseAddrPort("192.0.2.7:1"), ID: "a\xed\xa0\x80b"}, "is not well-formed UTF-8"},    // U+D800
		{ClientIdentity{Addr: netip.MustParseAddrPort("192.0.2.7:1"), ID: "a\xf4\x90\x80\x80"}, "is not well-formed UTF-8"}, // above U+10FFFF
		{ClientIdentity{Addr: netip.MustParseAddrPort("[64:ff9b:1:0:100::1]:1")}, "u octet"},
	} {
		_, err := tc.ci.Extension()
		if ReasonOf(err) != string(ReasonBadExtension) || !strings.Contains(err.Error(), tc.detail) {
			t.Errorf("%+v: %v, want bad-extension with %q", tc.ci, err, tc.detail)
		}
	}
	// Every character §3.1 refuses, alone and between letters, and the
	// neighbours it lets through.
	refused := map[rune]string{0x2028: "line or paragraph separator", 0x2029: "line or paragraph separator",
		0x200e: "bidirectional formatting character", 0x200f: "bidirectional formatting character", 0x061c: "bidirectional formatting character"}
	for r := rune(0); r <= 0x1f; r++ {
		refused[r] = "control character"
	}
	for r := rune(0x7f); r <= 0x9f; r++ {
		refused[r] = "control character"
	}
	for _, span := range [][2]rune{{0x202a, 0x202e}, {0x2066, 0x2069}} {
		for r := span[0]; r <= span[1]; r++ {
			refused[r] = "bidirectional formatting character"
		}
	}
	for r, class := range refused {
		for _, id := range []string{string(r), "a" + string(r) + "b"} {
			_, err := ClientIdentity{Addr: netip.MustParseAddrPort("192.0.2.7:1"), ID: id}.Extension()
			if want := fmt.Sprintf("holds %s %U", class, r); ReasonOf(err) != string(ReasonBadExtension) || !strings.Contains(err.Error(), want) {
				t.Errorf("identity %q: %v, want bad-extension with %q", id, err, want)
			}
		}
	}
	for _, r := range []rune{' ', '~', 0xa0, 0xad, 0x200b, 0x200c, 0x200d, 0x2027, 0x202f, 0x2065, 0x206a, 0x061b, 0x061d, 0xfeff, 0xfffd, 0x10ffff} {
		if _, err := (ClientIdentity{Addr: netip.MustParseAddrPort("192.0.2.7:1"), ID: "a" + string(r) + "b"}).Extension(); err != nil {
			t.Errorf("identity with %U refused: %v", r, err)
		}
	}
	for _, v := range [][]byte{nil, {5}, {4, 1, 2, 3}, {6, 1, 2, 3, 4, 5, 6, 7}} {
		if _, err := ParseClientIdentity(v); ReasonOf(err) != string(ReasonBadExtension) {
			t.Errorf("%x: %v", v, err)
		}
		_, err := signer.Sign(Claims{SandboxID: "s", Target: netip.MustParseAddrPort("10.0.0.1:1"),
			Extensions: []Extension{{Type: ExtClientIdentity, Value: v}}})
		if ReasonOf(err) != string(ReasonBadExtension) {
			t.Errorf("Sign with value %x: %v", v, err)
		}
	}
}

// FuzzClientIdentity: ParseClientIdentity never panics, and what it accepts
// re-encodes to the same bytes (one encoding per identity).
func FuzzClientIdentity(f *testing.F) {
	f.Add([]byte{4, 192, 0, 2, 7, 0xc3, 0x50, 'u'})
	f.Add([]byte{6, 0x20, 1, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0xbb})
	f.Fuzz(func(t *testing.T, v []byte) {
		ci, err := ParseClientIdentity(v)
		if err != nil {
			if ReasonOf(err) != string(ReasonBadExtension) {
				t.Fatalf("reason %q", ReasonOf(err))
			}
			if specClientIdentity(v, new(specClaims)) {
				t.Fatalf("spec decoder accepts %x, package says %v", v, err)
			}
			return
		}
		e, err := ci.Extension()
		if err != nil {
			t.Fatalf("accepted %x does not encode: %v", v, err)
		}
		if !bytes.Equal(e.Value, v) {
			t.Fatalf("accepted %x re-encodes to %x", v, e.Value)
		}
		var c specClaims
		if !specClientIdentity(v, &c) || c.client != ci.Addr || c.clientID != ci.ID {
			t.Fatalf("spec decoder disagrees on %x: %v %q", v, c.client, c.clientID)
		}
	})
}
