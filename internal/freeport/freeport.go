// Package freeport picks loopback ports for tests and the bench to listen
// on a while later: a port that nothing listens on, outside the kernel's
// ephemeral range (ip_local_port_range), and never the same twice in a
// process.
//
// A port of the ephemeral range, free when picked by listening on port 0
// and closing, can be taken before its listener binds it: by any
// connection made meanwhile, as its local port (whose TIME_WAIT then
// refuses the bind for a minute, and a dial to the port from that very
// port connects the socket to itself), or by another listener on port 0.
// No connection's local port and no port-0 listener comes from outside
// the range.
package freeport

import (
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"sync"
)

// Ports are picked from From up to the ephemeral range's start, and above
// its end: outside it.
const From = 10000

var picks struct {
	sync.Mutex
	done map[uint16]bool
}

// Addr returns a port on ip that nothing listens on, outside the ephemeral
// range, whose number no earlier call in this process returned. It fails
// when the range leaves no port outside it above From.
func Addr(ip netip.Addr) (netip.AddrPort, error) {
	low, high, err := EphemeralRange()
	if err != nil {
		return netip.AddrPort{}, err
	}
	below := max(0, low-From)   // From .. low-1
	above := max(0, 65535-high) // high+1 .. 65535
	if below+above == 0 {
		return netip.AddrPort{}, fmt.Errorf("freeport: the ephemeral range %d-%d leaves no port to listen on from %d", low, high, From)
	}
	picks.Lock()
	defer picks.Unlock()
	if picks.done == nil {
		picks.done = map[uint16]bool{}
	}
	for range 1000 {
		n := rand.IntN(below + above)
		port := uint16(From + n)
		if n >= below {
			port = uint16(high + 1 + n - below)
		}
		if picks.done[port] {
			continue
		}
		a := netip.AddrPortFrom(ip, port)
		ln, err := net.Listen("tcp", a.String())
		if err != nil {
			continue
		}
		ln.Close()
		picks.done[port] = true
		return a, nil
	}
	return netip.AddrPort{}, fmt.Errorf("freeport: no free port on %s outside the ephemeral range %d-%d", ip, low, high)
}

// EphemeralRange is the kernel's ip_local_port_range.
func EphemeralRange() (low, high int, err error) {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 0, 0, fmt.Errorf("freeport: %w", err)
	}
	if _, err := fmt.Sscan(string(b), &low, &high); err != nil {
		return 0, 0, fmt.Errorf("freeport: ip_local_port_range %q: %w", b, err)
	}
	return low, high, nil
}
