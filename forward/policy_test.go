package forward

import (
	"errors"
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
