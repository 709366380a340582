package forwardtest

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"os"
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
	for _, line := range strings.Split(string(data), "\n")[1:] {
		if f := strings.Fields(line); len(f) > 3 && f[1] == l && f[2] == r && f[3] == "01" {
			return true
		}
	}
	return false
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
