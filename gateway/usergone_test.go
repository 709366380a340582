package gateway

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// TestCarryUserGone: a user that left before its tunnel opened (a reset,
// or a FIN without close_notify) is not served. Before the dial nothing
// reaches the forwarder; once the forwarder's connection is ready, no
// preamble is written, so the forwarder opens no tunnel and dials no
// target. Carry and onDial say ErrUserGone. The connection left unused is
// kept as a standby connection where the Dialer keeps them, and the next
// user's tunnel takes it; else it is closed.
func TestCarryUserGone(t *testing.T) {
	leaves := map[string]func(t *testing.T, c *net.TCPConn){
		"reset": func(t *testing.T, c *net.TCPConn) {
			c.SetLinger(0)
			if err := c.Close(); err != nil {
				t.Fatal(err)
			}
		},
		"fin": func(t *testing.T, c *net.TCPConn) {
			if err := c.CloseWrite(); err != nil {
				t.Fatal(err)
			}
		},
	}
	for name, leave := range leaves {
		t.Run("before the dial/"+name, func(t *testing.T) {
			forwardtest.CheckLeaks(t)
			fx := newUserGoneFixture(t, 0)
			user, _, raw, srvRaw := userSession(t, fx.p)
			leave(t, raw)
			waitLeft(t, srvRaw)
			r := fx.carry(user)
			if !errors.Is(r.err, ErrUserGone) || r.end != "" || len(r.dials) != 1 || !errors.Is(r.dials[0], ErrUserGone) {
				t.Errorf("Carry: end %q, %v, dials %v; want ErrUserGone, no end, onDial told so once", r.end, r.err, r.dials)
			}
			if n := fx.gate.Accepted.Load(); n != 0 {
				t.Errorf("the forwarder's address got %d connections, want none", n)
			}
			if n := fx.up.Accepted(); n != 0 {
				t.Errorf("the sandbox got %d connections, want none", n)
			}
		})
		for _, standby := range []int{0, 1} {
			t.Run("during the dial/"+name+map[int]string{0: "", 1: "/standby kept"}[standby], func(t *testing.T) {
				forwardtest.CheckLeaks(t)
				fx := newUserGoneFixture(t, standby)
				user, _, raw, srvRaw := userSession(t, fx.p)
				done := make(chan relayResult, 1)
				go func() { done <- fx.carry(user) }()
				waitUntil(t, "the dial at the forwarder's address", func() bool { return fx.gate.Accepted.Load() == 1 })
				leave(t, raw)
				waitLeft(t, srvRaw)
				close(fx.gate.Release)
				r := <-done
				if !errors.Is(r.err, ErrUserGone) || r.end != "" || len(r.dials) != 1 || !errors.Is(r.dials[0], ErrUserGone) {
					t.Errorf("Carry: end %q, %v, dials %v; want ErrUserGone, no end, onDial told so once", r.end, r.err, r.dials)
				}
				if n := fx.up.Accepted(); n != 0 {
					t.Errorf("the sandbox got %d connections, want none", n)
				}
				if _, opened := fx.f.reg.Counts(); opened != 0 {
					t.Errorf("the forwarder opened %d tunnels, want none", opened)
				}
				if standby == 0 {
					// Closed in order: the forwarder read no preamble.
					if _, errs := fx.f.served(t, 1); errs[0] == nil {
						t.Error("the forwarder served the connection left unused")
					}
					return
				}
				// Kept: the next user's tunnel takes it.
				user2, client2, _, _ := userSession(t, fx.p)
				go func() { done <- fx.carry(user2) }()
				n, sum, err := transfer(client2)
				if r := <-done; r.err != nil || r.end != EndClosed {
					t.Errorf("the next user's Carry: end %q, %v; want %s", r.end, r.err, EndClosed)
				}
				if err != nil || n != 4<<10 || sum != forwardtest.PatternSum(2, 4<<10) {
					t.Errorf("the next user read %d bytes (want %d), the same hash %v, %v", n, 4<<10, sum == forwardtest.PatternSum(2, 4<<10), err)
				}
				if u := fx.standbyUsed.Load(); u != 1 {
					t.Errorf("the next user's tunnel took %d standby connections, want the one kept", u)
				}
			})
		}
	}
}

// userGoneFixture is a Dialer (userspace TLS) to a forwarder behind a
// relay that holds each connection until its Release is closed.
type userGoneFixture struct {
	p     pki
	d     *Dialer
	f     *forwarder
	gate  *forwardtest.HeldRelay
	up    *forwardtest.Upstream
	route Route
	// standbyUsed counts the standby connections Carry took.
	standbyUsed atomic.Int32
}

func newUserGoneFixture(t *testing.T, standby int) *userGoneFixture {
	t.Helper()
	fx := &userGoneFixture{p: newPKI(t), up: forwardtest.NewUpstream(t, 4<<10)}
	gw := forwardtest.NewGateway(t, "gw-1")
	fx.f = startForwarder(t, fx.p, gw, "127.0.0.0/8")
	fx.gate = forwardtest.NewHeldRelay(t)
	fx.gate.Target = fx.f.addr()
	var err error
	fx.d, err = New(Config{TLS: fx.p.client, Signer: gw.Signer, KTLS: ktls.Options{Disable: true}, Standby: standby,
		OnStandby: func(o string) {
			if o == StandbyUsed {
				fx.standbyUsed.Add(1)
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fx.d.Close() })
	fx.route = Route{Forwarder: fx.gate.Addr(), Sandbox: "sbx-gone", Target: fx.up.Addr()}
	return fx
}

// carry runs Carry for user and returns what it and onDial said.
func (fx *userGoneFixture) carry(user *ktls.Conn) relayResult {
	var r relayResult
	var mu sync.Mutex
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r.stats, r.end, r.err = fx.d.Carry(ctx, fx.route, user, nil, func(_ *ktls.Conn, err error) {
		mu.Lock()
		r.dials = append(r.dials, err)
		mu.Unlock()
	})
	return r
}

// userSession is a user's TLS session with the gateway (userspace TLS, the
// handshake done, nothing sent): the gateway's end, the user's, and the
// TCP sockets of the user and of the gateway.
func userSession(t *testing.T, p pki) (user *ktls.Conn, client *tls.Conn, raw, srvRaw *net.TCPConn) {
	t.Helper()
	raw, srvRaw = forwardtest.TCPPair(t)
	user = ktls.Server(srvRaw, &tls.Config{Certificates: p.server.Certificates}, ktls.Options{Disable: true})
	client = tls.Client(raw, &tls.Config{RootCAs: p.client.RootCAs, ServerName: "localhost"})
	t.Cleanup(func() { user.Close() })
	errc := make(chan error, 1)
	go func() { errc <- user.Handshake() }()
	if err := client.Handshake(); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	return user, client, raw, srvRaw
}

// transfer sends 1 KiB of pattern 7 on the user's session, half-closes it
// and reads the reply to its end: its length and SHA-256.
func transfer(c *tls.Conn) (int64, [32]byte, error) {
	c.SetDeadline(time.Now().Add(30 * time.Second))
	if _, err := io.Copy(c, io.LimitReader(forwardtest.NewPattern(7), 1<<10)); err != nil {
		return 0, [32]byte{}, err
	}
	if err := c.CloseWrite(); err != nil {
		return 0, [32]byte{}, err
	}
	h := sha256.New()
	n, err := io.Copy(h, c)
	return n, [32]byte(h.Sum(nil)), err
}

// waitLeft waits until the gateway's socket of a user session saw the
// user's reset or FIN.
func waitLeft(t *testing.T, c *net.TCPConn) {
	t.Helper()
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the user's end at the gateway's socket", func() bool {
		var state uint8
		rc.Control(func(fd uintptr) {
			if info, err := unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO); err == nil {
				state = info.State
			}
		})
		return state == unix.BPF_TCP_CLOSE || state == unix.BPF_TCP_CLOSE_WAIT
	})
}
