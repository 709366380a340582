package forward

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"sync"
	"syscall"
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
				checkLiveness(t, side, socketTo(t, peer), tc.wantKeepSecs, tc.wantUser)
			}
			c.CloseWrite()
			io.Copy(io.Discard, c)
			if errs := f.wait(t, 1); errs[0] != nil {
				t.Errorf("Serve: %v", errs[0])
			}
		})
	}
}

// A moved tunnel's sockets keep the liveness options the old forwarder
// gave them, read back with getsockopt(2) once only the adopted
// descriptors are left: not the adopting forwarder's options (a tunnel
// keeps what it was opened with, as across a reload), and not the defaults
// Go sets on a connection made from a file (keepalive at 15 s, 9 probes).
// The gateway's side here is plain TCP, adopted as the tests' tcpAdopt
// does; ktls.Adopt keeps a kernel TLS socket's options the same way
// (TestKernelAdopt).
func TestMoveKeepsSocketOptions(t *testing.T) {
	forwardtest.CheckLeaks(t)
	up := forwardtest.NewPacedUpstream(t, 1, time.Hour) // a byte, then quiet until the client's end
	old := newFixture(t, func(c *Config) {
		c.HandOffConn, c.AdoptConn = tcpHandOff, tcpAdopt
		c.KeepAlive, c.TCPUserTimeout = 7*time.Second, 1500*time.Millisecond
	})
	nu, nuReg := newProcess(t, old.gw, func(c *Config) { c.KeepAlive, c.TCPUserTimeout = 11*time.Second, 2500*time.Millisecond })
	c := old.dial(t)
	defer c.Close()
	if _, err := c.Write(old.gw.Frame(t, "sbx-sockopt", up.Addr())); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
		t.Fatal(err)
	}
	results := make(chan Result, 1)
	var runs sync.WaitGroup
	if res, _ := upgrade(t, old.reg, nu, nuReg, results, &runs); res.Moved != 1 {
		t.Fatalf("moved %d, stayed %v (%v); want the tunnel moved", res.Moved, res.Stayed, res.Stays)
	}
	old.wait(t, 1) // the old Serve has closed its descriptors
	sides := map[string]netip.AddrPort{
		"gateway side": c.LocalAddr().(*net.TCPAddr).AddrPort(),
		"sandbox side": up.Addr(),
	}
	for side, peer := range sides {
		checkLiveness(t, side+" after the move", socketTo(t, peer), 7, 1500)
	}
	c.CloseWrite()
	if n, err := io.Copy(io.Discard, c); n != 0 || err != nil {
		t.Errorf("the moved tunnel's end read %d bytes (%v), want its end alone", n, err)
	}
	runs.Wait()
	if res := <-results; res.Moved || res.Relay.BToA.Bytes != 1 {
		t.Errorf("adopted tunnel: moved %v, %d bytes down; want it ended here, its 1 byte counted", res.Moved, res.Relay.BToA.Bytes)
	}
}

// A moved tunnel's sockets travel as the forwarder holds them: each
// descriptor the Mover is given is the forwarder's own connection, the one
// socket of this process connected to its peer (no duplicate is made to
// pass it). A tunnel the other process refuses then stays on the same
// sockets, its session adopted back, and ends in order with its byte
// counted.
func TestMoveSendsTheSocketsItHolds(t *testing.T) {
	forwardtest.CheckLeaks(t)
	up := forwardtest.NewPacedUpstream(t, 1, time.Hour) // a byte, then quiet until the client's end
	old := newFixture(t, func(c *Config) { c.HandOffConn, c.AdoptConn = tcpHandOff, tcpAdopt })
	c := old.dial(t)
	defer c.Close()
	if _, err := c.Write(old.gw.Frame(t, "sbx-own", up.Addr())); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
		t.Fatal(err)
	}
	peers := []netip.AddrPort{c.LocalAddr().(*net.TCPAddr).AddrPort(), up.Addr()} // the gateway's side, the sandbox's
	type seen struct {
		typ  string
		fd   int
		held []int // this process's sockets connected to the peer
		err  error
	}
	var offered []seen
	mover := moverFunc(func(kind uint16, state []byte, files ...syscall.Conn) (bool, error) {
		for i, f := range files {
			o := seen{typ: fmt.Sprintf("%T", f)}
			o.fd, o.err = descriptor(f)
			if o.err == nil && i < len(peers) {
				o.held, o.err = socketsTo(peers[i])
			}
			offered = append(offered, o)
		}
		return false, errors.New("the test refuses")
	})
	if res := old.reg.MoveTunnels(t.Context(), mover); res.Moved != 0 || len(res.Stays) != 1 {
		t.Fatalf("moved %d, stays %v; want the tunnel refused", res.Moved, res.Stays)
	}
	if len(offered) != len(peers) {
		t.Fatalf("the Mover was given %+v; want the gateway's socket and the target's", offered)
	}
	for i, o := range offered {
		if o.err != nil || o.typ != "*net.TCPConn" || !slices.Equal(o.held, []int{o.fd}) {
			t.Errorf("descriptor %d: %+v; want the forwarder's own *net.TCPConn, the only socket connected to %v", i, o, peers[i])
		}
	}
	c.CloseWrite()
	if n, err := io.Copy(io.Discard, c); n != 0 || err != nil {
		t.Errorf("the tunnel's end read %d bytes (%v), want its end alone", n, err)
	}
	if errs := old.wait(t, 1); errs[0] != nil || old.res[0].Moved || old.res[0].Relay.BToA.Bytes != 1 {
		t.Errorf("the tunnel that stayed: %v, moved %v, %d bytes down; want it ended here, its 1 byte counted", errs[0], old.res[0].Moved, old.res[0].Relay.BToA.Bytes)
	}
}

// descriptor returns the descriptor s holds.
func descriptor(s syscall.Conn) (int, error) {
	rc, err := s.SyscallConn()
	if err != nil {
		return 0, err
	}
	var fd int
	err = rc.Control(func(d uintptr) { fd = int(d) })
	return fd, err
}

// checkLiveness reads the forwarder's liveness options on fd back with
// getsockopt(2): keepalive every keepSecs seconds, 3 probes,
// TCP_USER_TIMEOUT userMS (0: the kernel's default), Nagle off.
func checkLiveness(t *testing.T, side string, fd, keepSecs, userMS int) {
	t.Helper()
	for _, opt := range []struct {
		name       string
		level, opt int
		want       int
	}{
		{"SO_KEEPALIVE", unix.SOL_SOCKET, unix.SO_KEEPALIVE, 1},
		{"TCP_KEEPIDLE", unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, keepSecs},
		{"TCP_KEEPINTVL", unix.IPPROTO_TCP, unix.TCP_KEEPINTVL, keepSecs},
		{"TCP_KEEPCNT", unix.IPPROTO_TCP, unix.TCP_KEEPCNT, 3},
		{"TCP_USER_TIMEOUT", unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, userMS},
		{"TCP_NODELAY", unix.IPPROTO_TCP, unix.TCP_NODELAY, 1},
	} {
		if got, err := unix.GetsockoptInt(fd, opt.level, opt.opt); err != nil || got != opt.want {
			t.Errorf("%s: %s = %d (%v), want %d", side, opt.name, got, err, opt.want)
		}
	}
}

// socketTo returns this process's one socket whose peer is peer, found with
// getpeername(2) over /proc/self/fd: the test reads the forwarder's own
// sockets without a hook. The descriptor belongs to whoever opened it: only
// read it, while its tunnel is open.
func socketTo(t *testing.T, peer netip.AddrPort) int {
	t.Helper()
	found, err := socketsTo(peer)
	if err != nil {
		t.Fatal(err)
	}
	if len(found) != 1 {
		t.Fatalf("%d sockets connected to %v, want exactly one", len(found), peer)
	}
	return found[0]
}

// socketsTo returns this process's sockets whose peer is peer.
func socketsTo(peer netip.AddrPort) ([]int, error) {
	peer = netip.AddrPortFrom(peer.Addr().Unmap(), peer.Port())
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return nil, err
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
	return found, nil
}
