package forward

import (
	"errors"
	"net"
	"net/netip"
	"testing"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
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
		// 64:ff9b:1::/48 (RFC 8215 local-use): a /96 inside it, and the
		// other RFC 6052 layouts the address is well-formed for.
		{nat64, "[64:ff9b:1::a9fe:a9fe]:80", false},
		{nat64, "[64:ff9b:1:ab:cd00:ef:a9fe:a9fe]:80", false}, // bits 64-71 set: only a /96 fits
		{nat64, "[64:ff9b:1:ab:cd:ef:a9fe:a9fe]:80", false},
		{nat64, "[64:ff9b:1:ab:cd:ef:a01:203]:80", true},
		{nat64, "[64:ff9b:1:0:a9:fea9:fe00:0]:80", false},    // /64 layout of 169.254.169.254
		{nat64, "[64:ff9b:1:0:a:102:300:0]:80", true},        // /64 layout of 10.1.2.3 (its /96 reading 3.0.0.0)
		{nat64, "[64:ff9b:1:a9fe:a9:fe00::]:80", false},      // /48 layout (its /96 reading is 0.0.0.0)
		{nat64, "[64:ff9b:1:0:a9:fea9:fe00:1]:80", true},     // suffix not zero: /96 reading only, 254.0.0.1
		{nat64, "[64:ff9b:1:ff00:a9:fea9:fe00:0]:80", false}, // still the /64 layout (its prefix has a subnet)
		// Not a NAT64 prefix: judged as IPv6 alone.
		{[]string{"64:ff9b:2::/48"}, "[64:ff9b:2::a9fe:a9fe]:80", true},
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

// TestNAT64TargetDeniedLikeIPv4: through a Forwarder, a preamble naming
// 64:ff9b::a9fe:a9fe is refused with the reason 169.254.169.254 gets,
// target-denied (before any dial), under an allowlist that holds
// 64:ff9b::/96.
func TestNAT64TargetDeniedLikeIPv4(t *testing.T) {
	forwardtest.CheckLeaks(t)
	f := newFixture(t, func(c *Config) {
		pol, err := NewTargetPolicy([]string{"0.0.0.0/0", "64:ff9b::/96"}, nil)
		if err != nil {
			t.Fatal(err)
		}
		c.Policy = pol
	})
	for i, target := range []string{"169.254.169.254:80", "[64:ff9b::a9fe:a9fe]:80"} {
		frame := f.gw.Frame(t, "sbx", netip.MustParseAddrPort(target))
		err := f.refused(t, i+1, string(ReasonTargetDenied), func(c *net.TCPConn) { c.Write(frame) })
		if !errors.Is(err, ErrTargetDenied) {
			t.Errorf("%s: error %v does not wrap ErrTargetDenied", target, err)
		}
	}
	if got := f.reg.Rejections()[string(ReasonTargetDenied)]; got != 2 {
		t.Errorf("target-denied counted %d times, want 2", got)
	}
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
