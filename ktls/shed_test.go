package ktls

import (
	"crypto/tls"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestShed: a connection shed before its handshake ends the client's
// handshake with the server's access_denied alert, as crypto/tls and a
// ktls Client report it, whether the ClientHello was already queued at the
// server (read and dropped: no reset overtakes the alert) or arrives after
// the alert.
func TestShed(t *testing.T) {
	p := newTestPKI(t)
	_, ccfg := p.configs(connCase{version: tls.VersionTLS13})
	for _, c := range []struct {
		name   string
		queued bool // the ClientHello is in the server's receive queue when it sheds
		ktls   bool // the client is a ktls Client (userspace), as the gateway's
	}{
		{"hello queued, crypto/tls", true, false},
		{"hello queued, ktls client", true, true},
		{"hello after the alert, crypto/tls", false, false},
		{"hello after the alert, ktls client", false, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			a, b := loopbackPair(t)
			defer a.Close()
			a.SetDeadline(time.Now().Add(10 * time.Second))
			var client interface{ Handshake() error }
			if c.ktls {
				client = Client(a, ccfg, Options{Disable: true})
			} else {
				client = tls.Client(a, ccfg)
			}
			hs := make(chan error, 1)
			shed := make(chan error, 1)
			if c.queued {
				go func() { hs <- client.Handshake() }()
				waitReadable(t, b)
				go func() { shed <- Shed(b) }()
			} else {
				go func() { shed <- Shed(b) }()
				waitReadable(t, a)
				go func() { hs <- client.Handshake() }()
			}
			err := <-hs
			if err == nil || err.Error() != "remote error: tls: access denied" {
				t.Fatalf("client handshake: %v, want the server's access_denied", err)
			}
			// As a gateway does after a failed handshake.
			a.Close()
			if err := <-shed; err != nil {
				t.Fatalf("Shed: %v", err)
			}
		})
	}
}

// waitReadable blocks until c has bytes to read, without reading them.
func waitReadable(t *testing.T, c net.Conn) {
	t.Helper()
	rc, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var perr error
	err = rc.Read(func(fd uintptr) bool {
		_, _, perr = unix.Recvfrom(int(fd), make([]byte, 1), unix.MSG_PEEK|unix.MSG_DONTWAIT)
		return perr != unix.EAGAIN
	})
	if err != nil || perr != nil {
		t.Fatal(err, perr)
	}
}
