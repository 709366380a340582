package preamble

import (
	"bytes"
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
		{ClientIdentity{Addr: netip.MustParseAddrPort("192.0.2.7:1"), ID: "\xff"}, "is not UTF-8"},
	} {
		_, err := tc.ci.Extension()
		if ReasonOf(err) != string(ReasonBadExtension) || !strings.Contains(err.Error(), tc.detail) {
			t.Errorf("%+v: %v, want bad-extension with %q", tc.ci, err, tc.detail)
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
