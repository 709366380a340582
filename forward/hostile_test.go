package forward

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/sockerr"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

// refused sends what send writes on a fresh connection to f and checks the
// forwarder's answer: no byte, a reset (how a plain TCP client is refused),
// and Serve's reason, which must be one that Reasons or preamble.Reasons
// lists (the metrics pre-register a series for each listed reason only).
func (f *fixture) refused(t *testing.T, nth int, reason string, send func(c *net.TCPConn)) error {
	t.Helper()
	c := f.dial(t)
	defer c.Close()
	send(c)
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := io.Copy(io.Discard, c); n != 0 || !errors.Is(sockerr.ReadError(c, err), syscall.ECONNRESET) {
		t.Errorf("client read %d bytes, err %v; want none, then a reset", n, err)
	}
	err := f.wait(t, nth)[nth-1]
	got := ReasonOf(err)
	if got != reason {
		t.Errorf("reason %q (%v), want %q", got, err, reason)
	}
	if !slices.Contains(Reasons(), Reason(got)) && !slices.Contains(preamble.Reasons(), preamble.Reason(got)) {
		t.Errorf("reason %q is listed by neither forward.Reasons nor preamble.Reasons", got)
	}
	return err
}

// Hostile preambles beyond TestRejections: each is refused with its own
// reason, counted, and nothing is dialed.
func TestHostilePreambles(t *testing.T) {
	forwardtest.CheckLeaks(t)
	up := forwardtest.NewUpstream(t, 0)
	f := newFixture(t, nil)
	sign := func(c preamble.Claims) []byte {
		c.SandboxID, c.Target = "sbx", up.Addr()
		return f.gw.Sign(t, c)
	}
	oversized := sign(preamble.Claims{})
	binary.BigEndian.PutUint16(oversized[6:8], preamble.MaxFrameLen) // header + this body > the cap
	cases := []struct {
		name, reason string
		frame        []byte
	}{
		{"oversized", "oversized", oversized},
		{"expired", "expired", sign(preamble.Claims{IssuedAt: time.Now().Add(-10 * time.Minute), ExpiresAt: time.Now().Add(-9 * time.Minute)})},
		{"not-yet-valid", "not-yet-valid", sign(preamble.Claims{IssuedAt: time.Now().Add(9 * time.Minute), ExpiresAt: time.Now().Add(10 * time.Minute)})},
		{"ttl-too-long", "ttl-too-long", sign(preamble.Claims{ExpiresAt: time.Now().Add(time.Hour)})},
		// Plain TCP has no TLS session: a bound frame cannot match.
		{"binding-mismatch", "binding-mismatch", sign(preamble.Claims{Binding: bytes.Repeat([]byte{7}, preamble.BindingLen)})},
		{"bad-version", "bad-version", append([]byte("KTLP\x02"), sign(preamble.Claims{})[5:]...)},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f.refused(t, i+1, tc.reason, func(c *net.TCPConn) { c.Write(tc.frame) })
		})
	}
	if up.Accepted() != 0 {
		t.Errorf("upstream accepted %d connections for refused preambles", up.Accepted())
	}
	rej := f.reg.RefusedTunnels()
	for _, tc := range cases {
		if rej[tc.reason] != 1 {
			t.Errorf("rejections[%q] = %d, want 1 (all: %v)", tc.reason, rej[tc.reason], rej)
		}
	}
}

// Targets outside the allowlist, with a policy as wide as it gets (every
// address, one port): loopback, link-local (cloud metadata), this host's
// own address and another port are refused, and nothing listening there
// is dialed. A host with no address of its own besides loopback skips the
// host-address case loudly.
func TestHostileTargets(t *testing.T) {
	forwardtest.CheckLeaks(t)
	// Listens on every local address: a dial to loopback or to this host's
	// own address would land here.
	trap := forwardtest.NewUpstreamOn(t, ":0", 0)
	port := trap.Addr().Port()
	f := newFixture(t, func(c *Config) {
		pol, err := NewTargetPolicy([]string{"0.0.0.0/0", "::/0"}, []string{fmt.Sprint(port)})
		if err != nil {
			t.Fatal(err)
		}
		c.Policy = pol
	})
	addr := func(s string) func(testing.TB) netip.Addr {
		return func(testing.TB) netip.Addr { return netip.MustParseAddr(s) }
	}
	cases := []struct {
		name string
		addr func(testing.TB) netip.Addr
		port uint16
	}{
		{"loopback", addr("127.0.0.1"), port},
		{"loopback6", addr("::1"), port},
		{"link-local", addr("169.254.169.254"), port},
		{"host-address", forwardtest.HostAddress, port},
		{"port", addr("10.1.2.3"), port ^ 1},
	}
	n := 0 // cases run
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			target := netip.AddrPortFrom(tc.addr(t), tc.port)
			n++
			frame := f.gw.Frame(t, "sbx", target)
			err := f.refused(t, n, string(ReasonTargetDenied), func(c *net.TCPConn) { c.Write(frame) })
			if !errors.Is(err, ErrTargetDenied) {
				t.Errorf("error %v does not wrap ErrTargetDenied", err)
			}
		})
	}
	if got := trap.Accepted(); got != 0 {
		t.Errorf("refused targets were dialed %d times", got)
	}
	if got := f.reg.RefusedTunnels()[string(ReasonTargetDenied)]; got != uint64(n) {
		t.Errorf("target-denied counted %d times, want %d", got, n)
	}
}

// An upstream that never answers the connect: the tunnel is refused with
// dial-failed once dial_timeout has passed, and the error says it timed out.
func TestUpstreamBlackhole(t *testing.T) {
	forwardtest.CheckLeaks(t)
	target := forwardtest.Blackhole(t, netip.MustParseAddr("127.0.0.1"))
	f := newFixture(t, func(c *Config) { c.DialTimeout = 300 * time.Millisecond })
	err := f.refused(t, 1, string(ReasonDialFailed), func(c *net.TCPConn) { c.Write(f.gw.Frame(t, "sbx", target)) })
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Errorf("dial error %v is not a timeout", err)
	}
	if got := f.reg.RefusedTunnels()[string(ReasonDialFailed)]; got != 1 {
		t.Errorf("dial-failed counted %d times, want 1", got)
	}
}

// scriptedUpstream accepts one connection and runs serve on it.
func scriptedUpstream(t *testing.T, serve func(c *net.TCPConn)) netip.AddrPort {
	t.Helper()
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		c, err := ln.AcceptTCP()
		ln.Close()
		if err != nil {
			return
		}
		defer c.Close()
		serve(c)
	}()
	t.Cleanup(func() { ln.Close(); <-done })
	return ln.Addr().(*net.TCPAddr).AddrPort()
}

// The upstream answers a few bytes and closes before the client is done
// sending: the client gets exactly those bytes, then the end of the
// tunnel; nothing is left open.
func TestUpstreamClosesEarly(t *testing.T) {
	forwardtest.CheckLeaks(t)
	answer := []byte("bye")
	target := scriptedUpstream(t, func(c *net.TCPConn) {
		c.Read(make([]byte, 1024)) // the first client bytes, then leave
		c.Write(answer)
	})
	f := newFixture(t, nil)
	c := f.dial(t)
	defer c.Close()
	c.Write(f.gw.Frame(t, "sbx-early", target))
	go io.Copy(c, io.LimitReader(forwardtest.NewPattern(3), 64<<20)) // more than the upstream will ever read
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	got, err := io.ReadAll(c)
	err = sockerr.ReadError(c, err)
	if !bytes.Equal(got, answer) || (err != nil && !errors.Is(err, syscall.ECONNRESET)) {
		t.Errorf("client read %q, err %v; want %q then the end", got, err, answer)
	}
	f.wait(t, 1)
	if open, _ := f.reg.Counts(); open != 0 {
		t.Errorf("%d tunnels still open", open)
	}
}

// The gateway half-closes (sends all, then FIN) and keeps reading: the
// upstream sees EOF only after every byte, and its answer, written after
// that EOF, still reaches the gateway in full.
func TestGatewayHalfCloseKeepsReading(t *testing.T) {
	forwardtest.CheckLeaks(t)
	const send, answer = 3 << 20, 2 << 20
	var upRecv int64
	var upSum [32]byte
	target := scriptedUpstream(t, func(c *net.TCPConn) {
		h := sha256.New()
		upRecv, _ = io.Copy(h, c) // to the gateway's FIN
		copy(upSum[:], h.Sum(nil))
		io.Copy(c, io.LimitReader(forwardtest.NewPattern(8), answer))
		c.CloseWrite()
	})
	f := newFixture(t, nil)
	_, recvSum, recvN := runTunnel(t, f.dial(t), f.gw.Frame(t, "sbx-half", target), send, 4)
	if errs := f.wait(t, 1); errs[0] != nil {
		t.Errorf("Serve: %v", errs[0])
	}
	if upRecv != send || upSum != forwardtest.PatternSum(4, send) {
		t.Errorf("upstream received %d bytes, want %d with the gateway's hash", upRecv, send)
	}
	if recvN != answer || recvSum != forwardtest.PatternSum(8, answer) {
		t.Errorf("gateway received %d bytes after its half-close, want %d with the upstream's hash", recvN, answer)
	}
}
