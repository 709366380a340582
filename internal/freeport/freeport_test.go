package freeport

import (
	"net"
	"net/netip"
	"testing"
)

// TestAddr: the ports are free when picked, outside the ephemeral range
// (no connection's local port can take one before its listener binds it),
// and no port number is given twice, on any address.
func TestAddr(t *testing.T) {
	low, high, err := EphemeralRange()
	if err != nil {
		t.Fatal(err)
	}
	seen := map[uint16]bool{}
	for i := range 300 {
		ip := netip.AddrFrom4([4]byte{127, 0, 0, byte(1 + i%2)})
		a, err := Addr(ip)
		if err != nil {
			t.Fatal(err)
		}
		if p := int(a.Port()); seen[a.Port()] || (p >= low && p <= high) || p < From || a.Addr() != ip {
			t.Fatalf("picked %s (port seen before: %v); want a fresh port on %s from %d outside %d-%d", a, seen[a.Port()], ip, From, low, high)
		}
		seen[a.Port()] = true
		ln, err := net.Listen("tcp", a.String())
		if err != nil {
			t.Fatalf("the picked %s: %v", a, err)
		}
		ln.Close()
	}
}
