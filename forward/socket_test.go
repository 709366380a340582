package forward

import (
	"io"
	"net"
	"net/netip"
	"os"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
)

// The liveness options reach both kernel sockets of a tunnel, read back
// with getsockopt(2): the forwarder's socket to the gateway (accepted, where
// Go's listener already turned on its own 15 s keepalive, which must be
// replaced) and its socket to the sandbox (dialed). TCP_USER_TIMEOUT stays
// the kernel's default (0) unless configured.
func TestSocketOptionsOnBothSockets(t *testing.T) {
	for _, tc := range []struct {
		name                   string
		keepAlive, userTimeout time.Duration
		wantKeepSecs, wantUser int // seconds, milliseconds
	}{
		{"defaults", 0, 0, int(DefaultKeepAlive / time.Second), 0},
		{"configured", 7 * time.Second, 1500 * time.Millisecond, 7, 1500},
	} {
		t.Run(tc.name, func(t *testing.T) {
			forwardtest.CheckLeaks(t)
			up := forwardtest.NewUpstream(t, 0)
			f := newFixture(t, func(c *Config) { c.KeepAlive, c.TCPUserTimeout = tc.keepAlive, tc.userTimeout })
			c := f.dial(t)
			defer c.Close()
			if _, err := c.Write(append(f.gw.Frame(t, "sbx-sockopt", up.Addr()), 'x')); err != nil {
				t.Fatal(err)
			}
			// The byte behind the preamble was relayed: both sockets are
			// set up (the client's options are applied before the relay).
			deadline := time.Now().Add(10 * time.Second)
			for ts := f.reg.Tunnels(); len(ts) != 1 || ts[0].BytesToSandbox != 1; ts = f.reg.Tunnels() {
				if time.Now().After(deadline) {
					t.Fatalf("the tunnel did not relay its first byte: %+v", ts)
				}
				time.Sleep(5 * time.Millisecond)
			}
			sides := map[string]netip.AddrPort{
				"gateway side": c.LocalAddr().(*net.TCPAddr).AddrPort(),
				"sandbox side": up.Addr(),
			}
			for side, peer := range sides {
				fd := socketTo(t, peer)
				for _, opt := range []struct {
					name       string
					level, opt int
					want       int
				}{
					{"SO_KEEPALIVE", unix.SOL_SOCKET, unix.SO_KEEPALIVE, 1},
					{"TCP_KEEPIDLE", unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, tc.wantKeepSecs},
					{"TCP_KEEPINTVL", unix.IPPROTO_TCP, unix.TCP_KEEPINTVL, tc.wantKeepSecs},
					{"TCP_KEEPCNT", unix.IPPROTO_TCP, unix.TCP_KEEPCNT, 3},
					{"TCP_USER_TIMEOUT", unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, tc.wantUser},
				} {
					if got, err := unix.GetsockoptInt(fd, opt.level, opt.opt); err != nil || got != opt.want {
						t.Errorf("%s: %s = %d (%v), want %d", side, opt.name, got, err, opt.want)
					}
				}
			}
			c.CloseWrite()
			io.Copy(io.Discard, c)
			if errs := f.wait(t, 1); errs[0] != nil {
				t.Errorf("Serve: %v", errs[0])
			}
		})
	}
}

// socketTo returns this process's one socket whose peer is peer, found with
// getpeername(2) over /proc/self/fd: the test reads the forwarder's own
// sockets without a hook. The descriptor belongs to whoever opened it: only
// read it, while its tunnel is open.
func socketTo(t *testing.T, peer netip.AddrPort) int {
	t.Helper()
	peer = netip.AddrPortFrom(peer.Addr().Unmap(), peer.Port())
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	var found []int
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if sa, err := unix.Getpeername(fd); err == nil {
			if in4, ok := sa.(*unix.SockaddrInet4); ok && netip.AddrPortFrom(netip.AddrFrom4(in4.Addr), uint16(in4.Port)) == peer {
				found = append(found, fd)
			}
		}
	}
	if len(found) != 1 {
		t.Fatalf("%d sockets connected to %v, want exactly one", len(found), peer)
	}
	return found[0]
}
