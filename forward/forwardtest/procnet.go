package forwardtest

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// Established reports whether /proc/net/tcp holds an ESTABLISHED socket
// whose local address is local and remote address remote (IPv4
// "ip:port"): a test's view of a socket another process, or a library,
// holds.
func Established(t testing.TB, local, remote string) bool {
	t.Helper()
	data, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		t.Fatal(err)
	}
	l, r := procNetTCPAddr(t, local), procNetTCPAddr(t, remote)
	for _, f := range ProcNetTCPLines(data) {
		if f[1] == l && f[2] == r && f[3] == "01" {
			return true
		}
	}
	return false
}

// ProcNetTCPLines returns the fields of each socket's line of
// /proc/net/tcp or /proc/net/tcp6 (data), the header left out.
func ProcNetTCPLines(data []byte) [][]string {
	var out [][]string
	for _, line := range strings.Split(string(data), "\n")[1:] {
		if f := strings.Fields(line); len(f) > 9 {
			out = append(out, f)
		}
	}
	return out
}

// ProcNetAddr decodes a /proc/net/tcp address ("0100007F:1F90", the IPv6
// form in four little-endian words) as ip:port.
func ProcNetAddr(t testing.TB, s string) string {
	t.Helper()
	hexIP, hexPort, _ := strings.Cut(s, ":")
	port, err := strconv.ParseUint(hexPort, 16, 16)
	if err != nil {
		t.Fatal(err)
	}
	raw := make(net.IP, len(hexIP)/2)
	for i := range raw {
		b, err := strconv.ParseUint(hexIP[2*i:2*i+2], 16, 8)
		if err != nil {
			t.Fatal(err)
		}
		raw[i] = byte(b)
	}
	for w := 0; w < len(raw); w += 4 { // each 32-bit word is in host (little-endian) order
		slices.Reverse(raw[w : w+4])
	}
	return net.JoinHostPort(raw.String(), strconv.Itoa(int(port)))
}

// QueuedSockets lists the sockets of /proc/net/tcp (data) that hold bytes
// to send or to read, a line each: local and remote address, state and
// tx_queue:rx_queue (hex), for a test that logs where bytes wait.
func QueuedSockets(t testing.TB, data []byte) string {
	t.Helper()
	var b strings.Builder
	for _, f := range ProcNetTCPLines(data) {
		if f[4] != "00000000:00000000" {
			fmt.Fprintf(&b, "\n  %s %s st %s tx:rx %s", ProcNetAddr(t, f[1]), ProcNetAddr(t, f[2]), f[3], f[4])
		}
	}
	return b.String()
}

// GoroutineBlocks returns the stacks of a goroutine dump (runtime.Stack
// of all goroutines, or a goroutine profile) that mention one of subs.
func GoroutineBlocks(dump string, subs ...string) string {
	var keep []string
	for _, block := range strings.Split(dump, "\n\n") {
		for _, sub := range subs {
			if strings.Contains(block, sub) {
				keep = append(keep, block)
				break
			}
		}
	}
	return strings.Join(keep, "\n\n")
}

// procNetTCPAddr writes an IPv4 ip:port as /proc/net/tcp does: the
// address's 32-bit word in the host's (little-endian) order, then the
// port, in hex.
func procNetTCPAddr(t testing.TB, hostport string) string {
	t.Helper()
	ap, err := netip.ParseAddrPort(hostport)
	if err != nil || !ap.Addr().Unmap().Is4() {
		t.Fatalf("%q is no IPv4 ip:port", hostport)
	}
	ip := ap.Addr().Unmap().As4()
	return fmt.Sprintf("%08X:%04X", binary.LittleEndian.Uint32(ip[:]), ap.Port())
}
