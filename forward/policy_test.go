package forward

import (
	"bytes"
	"crypto/ed25519"
	"errors"
	"net"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

func TestTargetPolicy(t *testing.T) {
	cases := []struct {
		allow, ports []string
		target       string
		ok           bool
	}{
		{nil, nil, "10.1.2.3:22", true},
		{nil, nil, "127.0.0.1:80", false},
		{nil, nil, "[::1]:80", false},
		{nil, nil, "169.254.169.254:80", false},
		{nil, nil, "[fe80::1]:80", false},
		{nil, nil, "224.0.0.1:80", false},
		{nil, nil, "0.0.0.0:80", false},
		{nil, nil, "255.255.255.255:80", false},
		{nil, nil, "[::ffff:127.0.0.1]:80", false}, // IPv4-mapped loopback
		{[]string{"0.0.0.0/0"}, nil, "127.0.0.1:80", false},
		{[]string{"0.0.0.0/0"}, nil, "169.254.169.254:80", false},
		{[]string{"127.0.0.0/8"}, nil, "127.0.0.1:80", true},
		{[]string{"127.0.0.1"}, nil, "127.0.0.1:80", true},
		{[]string{"127.0.0.1"}, nil, "127.0.0.2:80", false},
		{[]string{"10.0.0.0/8"}, nil, "10.9.9.9:1", true},
		{[]string{"10.0.0.0/8"}, nil, "192.168.1.1:1", false},
		{[]string{"10.0.0.0/8"}, []string{"22", "8000-8999"}, "10.0.0.1:22", true},
		{[]string{"10.0.0.0/8"}, []string{"22", "8000-8999"}, "10.0.0.1:8500", true},
		{[]string{"10.0.0.0/8"}, []string{"22", "8000-8999"}, "10.0.0.1:9000", false},
		{[]string{"fd00::/8"}, nil, "[fd00::5]:443", true},
	}
	for _, tc := range cases {
		p, err := NewTargetPolicy(tc.allow, tc.ports)
		if err != nil {
			t.Fatal(err)
		}
		err = p.Check(netip.MustParseAddrPort(tc.target))
		if (err == nil) != tc.ok {
			t.Errorf("allow %v ports %v: Check(%s) = %v, want ok=%v", tc.allow, tc.ports, tc.target, err, tc.ok)
		}
		if err != nil && !errors.Is(err, ErrTargetDenied) {
			t.Errorf("error %v does not wrap ErrTargetDenied", err)
		}
	}
	t.Run("host-address", func(t *testing.T) {
		hostAddr := forwardtest.HostAddress(t) // skips loudly on a host without one
		wide, _ := NewTargetPolicy([]string{"0.0.0.0/0", "::/0"}, nil)
		target := netip.AddrPortFrom(hostAddr, 22)
		if wide.Check(target) == nil {
			t.Errorf("host interface address %s allowed by a wide prefix", hostAddr)
		}
		exact, _ := NewTargetPolicy([]string{hostAddr.String()}, nil)
		if err := exact.Check(target); err != nil {
			t.Errorf("host address named exactly is still refused: %v", err)
		}
	})
}

// TestTargetPolicyNAT64: an address in a NAT64 prefix is refused exactly as
// the IPv4 address it embeds is, with the same error (ErrTargetDenied, so
// target-denied), even when an allowed prefix contains the NAT64 address;
// only an allowed IPv4 prefix inside the refused range opens it.
func TestTargetPolicyNAT64(t *testing.T) {
	nat64 := []string{"10.0.0.0/8", "64:ff9b::/96", "64:ff9b:1::/48"}
	cases := []struct {
		allow  []string
		target string
		ok     bool
	}{
		// 64:ff9b::/96 (RFC 6052 well-known): the IPv4 address in the last 32 bits.
		{nat64, "169.254.169.254:80", false},
		{nat64, "[64:ff9b::a9fe:a9fe]:80", false},   // 169.254.169.254
		{nat64, "[64:ff9b::169.254.0.1]:80", false}, // link-local
		{nat64, "[64:ff9b::7f00:1]:80", false},      // 127.0.0.1
		{nat64, "[64:ff9b::e000:1]:80", false},      // 224.0.0.1
		{nat64, "[64:ff9b::]:80", false},            // 0.0.0.0
		{nat64, "[64:ff9b::ffff:ffff]:80", false},   // 255.255.255.255
		{nat64, "[64:ff9b::a01:203]:80", true},      // 10.1.2.3
		{nat64, "[64:ff9b::c000:20a]:80", true},     // 192.0.2.10
		{nil, "[64:ff9b::a9fe:a9fe]:80", false},     // no allowlist: still refused
		{[]string{"::/0"}, "[64:ff9b::a9fe:a9fe]:80", false},
		{[]string{"64:ff9b::a9fe:a9fe"}, "[64:ff9b::a9fe:a9fe]:80", false},             // naming the IPv6 form does not open it
		{[]string{"64:ff9b::/96", "169.254.169.254"}, "[64:ff9b::a9fe:a9fe]:80", true}, // the IPv4 form does, as for IPv4
		{[]string{"64:ff9b::/96", "127.0.0.0/8"}, "[64:ff9b::7f00:1]:80", true},
		{[]string{"10.0.0.0/8"}, "[64:ff9b::a01:203]:80", false}, // allowed prefixes apply to the address as written
		// 64:ff9b:1::/48 (RFC 8215 local-use): every reading, /48, /56,
		// /64 and /96, whatever the suffix holds (#31 item 1: the /48
		// reading of 169.254.169.254 behind a suffix that reads 10.1.2.3).
		{nat64, "[64:ff9b:1:a9fe:a9:fe00:a01:203]:80", false},
		{nat64, "[64:ff9b:1:a9fe:a9:fe00::]:80", false},
		{nat64, "[64:ff9b:1:aa9:fe:a9fe:a01:203]:80", false},  // /56 reading 169.254.169.254
		{nat64, "[64:ff9b:1:a0a:a9:fea9:fe01:203]:80", false}, // /64 reading 169.254.169.254
		{nat64, "[64:ff9b:1:a0a:7f:0:1:203]:80", false},       // /64 reading 127.0.0.1
		{nat64, "[64:ff9b:1:a0a:a:a0a:a9fe:a9fe]:80", false},  // /96 reading 169.254.169.254
		{nat64, "[64:ff9b:1:a0a:a:a0a:a01:203]:80", true},     // every reading in 10.0.0.0/8
		{nat64, "[64:ff9b:1:ab:cd:ef:a01:203]:80", false},     // /48 reading 0.171.205.0
		{nat64, "[64:ff9b:1:0:a:102:300:0]:80", false},        // /64 of 10.1.2.3, but its /48 reading is 0.0.10.1
		{nat64, "[64:ff9b:1:a01:2:300::]:80", false},          // /48 of 10.1.2.3, but its /96 reading is 0.0.0.0
		{nat64, "[64:ff9b:1:ab:cd00:ef:a9fe:a9fe]:80", false}, // u octet set: malformed
		{nat64, "[64:ff9b:1:a0a:a00:a0a:a01:203]:80", false},  // u octet set: malformed
		// SIIT IPv4-translated (::ffff:0:0:0/96, RFC 2765) and 6to4
		// (2002::/16, RFC 3056), under ::/0.
		{[]string{"::/0"}, "[::ffff:0:a9fe:a9fe]:80", false},
		{[]string{"::/0"}, "[::ffff:0:7f00:1]:80", false},
		{[]string{"::/0"}, "[::ffff:0:a01:203]:80", true},
		{[]string{"::/0", "169.254.169.254"}, "[::ffff:0:a9fe:a9fe]:80", true},
		{[]string{"::/0"}, "[2002:a9fe:a9fe::1]:80", false},
		{[]string{"::/0"}, "[2002:7f00:1:5::1]:80", false},
		{[]string{"::/0"}, "[2002:a01:203::1]:80", true},
		{[]string{"::/0"}, "[2002:a01:203:a9fe::a9fe:a9fe]:80", true}, // 6to4 reads bits 16-47 only
		{[]string{"::/0", "127.0.0.0/8"}, "[2002:7f00:1::1]:80", true},
		// Not a translation prefix: judged as IPv6 alone.
		{[]string{"64:ff9b:2::/48"}, "[64:ff9b:2::a9fe:a9fe]:80", true},
		{[]string{"::/0"}, "[::fffe:0:a9fe:a9fe]:80", true},
		{[]string{"::/0"}, "[2003:a9fe:a9fe::1]:80", true},
	}
	for _, tc := range cases {
		p, err := NewTargetPolicy(tc.allow, nil)
		if err != nil {
			t.Fatal(err)
		}
		err = p.Check(netip.MustParseAddrPort(tc.target))
		if (err == nil) != tc.ok {
			t.Errorf("allow %v: Check(%s) = %v, want ok=%v", tc.allow, tc.target, err, tc.ok)
		}
		if err != nil && !errors.Is(err, ErrTargetDenied) {
			t.Errorf("error %v does not wrap ErrTargetDenied", err)
		}
	}
}

// embed6052 writes v4 into prefix as RFC 6052 §2.2 says, independently of
// the package's table: the 32 bits of v4 follow the first bits of prefix,
// skipping bits 64-71 (the u octet, zero); every other bit after them
// comes from fill (the suffix, which a translator ignores).
func embed6052(prefix string, bits int, v4 netip.Addr, fill byte) netip.Addr {
	b := netip.MustParseAddr(prefix).As16()
	set := func(i int, on bool) {
		if on {
			b[i/8] |= 0x80 >> (i % 8)
		} else {
			b[i/8] &^= 0x80 >> (i % 8)
		}
	}
	src := v4.As4()
	pos := bits
	for i := 0; i < 32; i++ {
		if pos == 64 {
			pos = 72
		}
		set(pos, src[i/8]&(0x80>>(i%8)) != 0)
		pos++
	}
	for ; pos < 128; pos++ {
		set(pos, fill&(0x80>>(pos%8)) != 0)
	}
	if bits < 96 {
		b[8] = 0
	}
	return netip.AddrFrom16(b)
}

// read6052 is embed6052's inverse: the 32 bits after the first bits of a,
// skipping bits 64-71.
func read6052(a netip.Addr, bits int) netip.Addr {
	b := a.As16()
	var out [4]byte
	pos := bits
	for i := 0; i < 32; i++ {
		if pos == 64 {
			pos = 72
		}
		if b[pos/8]&(0x80>>(pos%8)) != 0 {
			out[i/8] |= 0x80 >> (i % 8)
		}
		pos++
	}
	return netip.AddrFrom4(out)
}

// refusedByDefault reports whether an IPv4 address lies in a range every
// policy refuses (this host's own addresses aside).
func refusedByDefault(a netip.Addr) bool {
	for _, r := range []string{"127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "0.0.0.0/8", "255.255.255.255/32"} {
		if netip.MustParsePrefix(r).Contains(a) {
			return true
		}
	}
	return false
}

// TestTargetPolicyEmbeddedIPv4: each form that stands for an IPv4 address
// (NAT64 at every RFC 6052 prefix length, SIIT, 6to4), for the cloud
// metadata address, loopback and a private address, with suffixes of
// several values: a refused IPv4 address is refused in every form, under an
// allowlist that holds the form's prefix (::/0), whatever the suffix says,
// and the error names it; the private one passes unless another reading of
// the address is refused. Only an allowed IPv4 prefix inside the refused
// range opens a form, and only where no other reading is refused. Declared
// NAT64 prefixes (the operator's translators) are read at their own length
// alone; 64:ff9b:1::/48 otherwise at /48, /56, /64 and /96.
func TestTargetPolicyEmbeddedIPv4(t *testing.T) {
	metadata, loopback, private := netip.MustParseAddr("169.254.169.254"), netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("10.1.2.3")
	nat64Form := func(prefix string, bits int) func(netip.Addr, byte) netip.Addr {
		return func(v4 netip.Addr, fill byte) netip.Addr { return embed6052(prefix, bits, v4, fill) }
	}
	all := []int{48, 56, 64, 96}
	forms := []struct {
		name     string
		declared []string // declared NAT64 prefixes
		encode   func(v4 netip.Addr, fill byte) netip.Addr
		readings []int // RFC 6052 lengths the address is read at; nil: read by other
		other    func(netip.Addr) netip.Addr
	}{
		{"well-known /96", nil, nat64Form("64:ff9b::", 96), []int{96}, nil},
		{"local-use /48", nil, nat64Form("64:ff9b:1::", 48), all, nil},
		{"local-use /56", nil, nat64Form("64:ff9b:1:a00::", 56), all, nil},
		{"local-use /64", nil, nat64Form("64:ff9b:1:a0a::", 64), all, nil},
		{"local-use /96", nil, nat64Form("64:ff9b:1:a0a:a:a0a::", 96), all, nil},
		{"declared local-use /48", []string{"64:ff9b:1::/48"}, nat64Form("64:ff9b:1::", 48), []int{48}, nil},
		{"declared local-use /56", []string{"64:ff9b:1:100::/56"}, nat64Form("64:ff9b:1:100::", 56), []int{56}, nil},
		{"declared local-use /64", []string{"64:ff9b:1:1::/64"}, nat64Form("64:ff9b:1:1::", 64), []int{64}, nil},
		{"declared local-use /96", []string{"64:ff9b:1:1::/96"}, nat64Form("64:ff9b:1:1::", 96), []int{96}, nil},
		{"declared /32", []string{"2001:db8::/32"}, nat64Form("2001:db8::", 32), []int{32}, nil},
		{"declared /40", []string{"2001:db8:100::/40"}, nat64Form("2001:db8:100::", 40), []int{40}, nil},
		{"declared /48", []string{"2001:db8:64::/48"}, nat64Form("2001:db8:64::", 48), []int{48}, nil},
		{"declared /56", []string{"2001:db8:64:6400::/56"}, nat64Form("2001:db8:64:6400::", 56), []int{56}, nil},
		{"declared /64", []string{"2001:db8:64:64::/64"}, nat64Form("2001:db8:64:64::", 64), []int{64}, nil},
		{"declared /96", []string{"2001:db8:64:64::/96"}, nat64Form("2001:db8:64:64::", 96), []int{96}, nil},
		{"SIIT", nil, func(v4 netip.Addr, _ byte) netip.Addr {
			b := v4.As4()
			return netip.AddrFrom16([16]byte{8: 0xff, 9: 0xff, 12: b[0], 13: b[1], 14: b[2], 15: b[3]})
		}, nil, func(a netip.Addr) netip.Addr { return netip.AddrFrom4([4]byte(a.AsSlice()[12:])) }},
		{"6to4", nil, func(v4 netip.Addr, fill byte) netip.Addr {
			b := v4.As4()
			return netip.AddrFrom16([16]byte{0x20, 0x02, b[0], b[1], b[2], b[3], fill, fill, 8: fill, 15: 1})
		}, nil, func(a netip.Addr) netip.Addr { return netip.AddrFrom4([4]byte(a.AsSlice()[2:6])) }},
	}
	for _, f := range forms {
		for _, fill := range []byte{0x00, 0x0a, 0xa9, 0x7f} {
			for _, v4 := range []netip.Addr{metadata, loopback, private} {
				target := netip.AddrPortFrom(f.encode(v4, fill), 80)
				// What the address reads as, by this test's own reading.
				var readings []netip.Addr
				for _, bits := range f.readings {
					readings = append(readings, read6052(target.Addr(), bits))
				}
				if f.other != nil {
					readings = append(readings, f.other(target.Addr()))
				}
				if !slices.Contains(readings, v4) {
					t.Fatalf("%s: %s reads as %v, which lacks %s", f.name, target, readings, v4)
				}
				othersRefused := false
				for _, r := range readings {
					if r != v4 && refusedByDefault(r) {
						othersRefused = true
					}
				}
				for _, allow := range [][]string{{"::/0"}, {"::/0", "0.0.0.0/0"}} {
					p, err := NewTargetPolicy(allow, nil, f.declared...)
					if err != nil {
						t.Fatal(err)
					}
					err = p.Check(target)
					wantOK := v4 == private && !othersRefused
					if (err == nil) != wantOK {
						t.Errorf("%s, %s, fill %#02x: Check(%s) under allow %v, NAT64 %v = %v, want ok=%v (readings %v)", f.name, v4, fill, target, allow, f.declared, err, wantOK, readings)
						continue
					}
					if err != nil && !errors.Is(err, ErrTargetDenied) {
						t.Errorf("%s: error %v does not wrap ErrTargetDenied", f.name, err)
					}
					if err != nil && v4 != private && !othersRefused && !strings.Contains(err.Error(), "reaches "+v4.String()+" as ") {
						t.Errorf("%s: error %q does not name %s", f.name, err, v4)
					}
				}
				if v4 == private {
					continue
				}
				p, err := NewTargetPolicy([]string{"::/0", v4.String()}, nil, f.declared...)
				if err != nil {
					t.Fatal(err)
				}
				if err := p.Check(target); (err == nil) != !othersRefused {
					t.Errorf("%s, %s, fill %#02x: Check(%s) with %s allowed: %v, want ok=%v (readings %v)", f.name, v4, fill, target, v4, err, !othersRefused, readings)
				}
			}
		}
	}
}

// TestTargetPolicyNAT64Declared: a declared NAT64 prefix must be an RFC 6052
// one; an address in a declared prefix of /64 or shorter whose u octet is
// set is refused.
func TestTargetPolicyNAT64Declared(t *testing.T) {
	for _, bad := range []string{"2001:db8::/33", "2001:db8::/128", "10.0.0.0/8", "2001:db8:0:0:100::/96", "64:ff9b::/32",
		"64:ff9b::/64", "64:ff9b::a00:0/104", "nonsense", "::ffff:0:0/96"} {
		if _, err := NewTargetPolicy([]string{"::/0"}, nil, bad); err == nil {
			t.Errorf("NAT64 prefix %q accepted", bad)
		}
	}
	p, err := NewTargetPolicy([]string{"::/0"}, nil, "64:ff9b::/96", "2001:db8:64::/48", "2001:db9::/32")
	if err != nil {
		t.Fatal(err)
	}
	// Overlapping declarations: an address is judged by each that holds it.
	overlap, err := NewTargetPolicy([]string{"::/0"}, nil, "2001:db8::/32", "2001:db8:64::/48")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		p            *TargetPolicy
		target, want string
	}{
		{p, "[2001:db8:64:a01:ff02:300::]:80", "u octet"}, // /48 with the u octet set
		{p, "[2001:db9:a01:203:ff00::]:80", "u octet"},    // /32 with the u octet set
		{p, "[2001:db8:64:7f00:0:100::]:80", "reaches 127.0.0.1 as NAT64 in the declared prefix 2001:db8:64::/48 (the /48 reading)"},
		{p, "[2001:db9:a9fe:a9fe::]:80", "reaches 169.254.169.254 as NAT64 in the declared prefix 2001:db9::/32 (the /32 reading)"},
		{p, "[2001:db9:a9fe:a9fe:0:a01:203:0]:80", "reaches 169.254.169.254"}, // the suffix does not hide it
		{p, "[64:ff9b::7f00:1]:80", "reaches 127.0.0.1"},
		{p, "[2001:db8:64:a01:2:300::1]:80", ""},
		{p, "[2001:db9:a01:203::]:80", ""},
		{overlap, "[2001:db8:64:a01:2:300::]:80", "reaches 0.100.10.1 as NAT64 in the declared prefix 2001:db8::/32 (the /32 reading)"},
	} {
		err := tc.p.Check(netip.MustParseAddrPort(tc.target))
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("Check(%s) = %v, want %q", tc.target, err, tc.want)
		}
	}
}

// TestNAT64TargetDeniedLikeIPv4: through a Forwarder, a preamble naming
// 169.254.169.254 in any form that reaches it (NAT64 well-known, the /48
// reading of the local-use prefix behind a suffix that reads 10.1.2.3,
// SIIT, 6to4) is refused with the reason 169.254.169.254 gets,
// target-denied (before any dial), under an allowlist that holds every
// IPv6 address; a local-use address whose u octet is set is refused as a
// bad frame, bad-target, before the policy sees it.
func TestNAT64TargetDeniedLikeIPv4(t *testing.T) {
	forwardtest.CheckLeaks(t)
	f := newFixture(t, func(c *Config) {
		pol, err := NewTargetPolicy([]string{"0.0.0.0/0", "::/0"}, nil)
		if err != nil {
			t.Fatal(err)
		}
		c.Policy = pol
	})
	targets := []string{"169.254.169.254:80", "[64:ff9b::a9fe:a9fe]:80", "[64:ff9b:1:a9fe:a9:fe00:a01:203]:80",
		"[::ffff:0:a9fe:a9fe]:80", "[2002:a9fe:a9fe::1]:80"}
	for i, target := range targets {
		frame := f.gw.Frame(t, "sbx", netip.MustParseAddrPort(target))
		err := f.refused(t, i+1, string(ReasonTargetDenied), func(c *net.TCPConn) { c.Write(frame) })
		if !errors.Is(err, ErrTargetDenied) {
			t.Errorf("%s: error %v does not wrap ErrTargetDenied", target, err)
		}
	}
	if got := f.reg.RefusedTunnels()[string(ReasonTargetDenied)]; got != uint64(len(targets)) {
		t.Errorf("target-denied counted %d times, want %d", got, len(targets))
	}
	// The signer refuses to write the malformed NAT64 address: build the
	// frame for a valid one and set its u octet, then sign it again.
	c := preamble.Claims{SandboxID: "sbx", Target: netip.MustParseAddrPort("[64:ff9b:1:a9fe:a9:fe00:a01:203]:80")}
	frame := f.gw.Sign(t, c)
	at := bytes.Index(frame, netip.MustParseAddr("64:ff9b:1:a9fe:a9:fe00:a01:203").AsSlice())
	frame[at+8] = 0xff
	body := frame[:len(frame)-preamble.SignatureLen]
	frame = append(body, ed25519.Sign(f.gw.Key, append([]byte(preamble.SignatureContext), body...))...)
	f.refused(t, len(targets)+1, string(preamble.ReasonBadTarget), func(c *net.TCPConn) { c.Write(frame) })
}

func TestTargetPolicyBadConfig(t *testing.T) {
	for _, tc := range []struct{ allow, ports []string }{
		{[]string{"10.0.0.0/33"}, nil},
		{[]string{"example.com"}, nil},
		{[]string{"::ffff:10.0.0.0/104"}, nil},
		{nil, []string{"0"}},
		{nil, []string{"70000"}},
		{nil, []string{"90-80"}},
		{nil, []string{"http"}},
	} {
		if _, err := NewTargetPolicy(tc.allow, tc.ports); err == nil {
			t.Errorf("NewTargetPolicy(%v, %v) accepted a bad entry", tc.allow, tc.ports)
		}
	}
}
