package sockerr

import (
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"
	"testing"
	"time"
)

// ReadError replaces only a "not pollable" error, and only with the
// socket's pending error: a reset still pending on the socket comes back as
// ECONNRESET, also through NetConn; nil, io.EOF and other errors, and a
// "not pollable" on a socket with no pending error, come back unchanged.
func TestReadError(t *testing.T) {
	notPollable := &net.OpError{Op: "read", Net: "tcp", Err: errors.New("not pollable")}
	if !NotPollable(fmt.Errorf("source: %w", notPollable)) || NotPollable(io.EOF) || NotPollable(nil) {
		t.Error("NotPollable: want true for a wrapped \"not pollable\" only")
	}
	reset, resetter := tcpPair(t)
	healthy, _ := tcpPair(t)
	// The peer resets the connection; nothing reads it, so the reset stays
	// the socket's pending error once the connection is closed.
	resetter.SetLinger(0)
	resetter.Close()
	for deadline := time.Now().Add(5 * time.Second); !Reset(reset); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the connection is not closed 5 s after the peer's reset")
		}
	}
	if Reset(healthy) {
		t.Error("Reset: true for a connection nobody reset")
	}
	for _, err := range []error{nil, io.EOF, syscall.EPIPE} {
		if got := ReadError(reset, err); got != err {
			t.Errorf("ReadError(%v) = %v, want it unchanged", err, got)
		}
	}
	if got := ReadError(healthy, notPollable); got != notPollable {
		t.Errorf("not pollable, no pending error: %v, want it unchanged", got)
	}
	// Through NetConn, as a *tls.Conn offers its socket.
	if got := ReadError(tls.Client(reset, nil), fmt.Errorf("source: %w", notPollable)); !errors.Is(got, syscall.ECONNRESET) {
		t.Errorf("not pollable on a reset socket: %v, want ECONNRESET", got)
	}
	// The error was taken: the socket has none left.
	if got := ReadError(reset, notPollable); got != notPollable {
		t.Errorf("not pollable a second time: %v, want it unchanged", got)
	}
}

// TCPConn follows NetConn down to the TCP socket and gives up on a
// connection that offers none.
func TestTCPConn(t *testing.T) {
	c, _ := tcpPair(t)
	if got := TCPConn(tls.Server(tls.Client(c, nil), nil)); got != c {
		t.Errorf("TCPConn through two TLS layers = %v, want the socket", got)
	}
	p, q := net.Pipe()
	defer p.Close()
	defer q.Close()
	if got := TCPConn(tls.Client(p, nil)); got != nil {
		t.Errorf("TCPConn over a net.Pipe = %v, want nil", got)
	}
}

// tcpPair returns the two ends of one loopback TCP connection, closed at
// the end of the test.
func tcpPair(t *testing.T) (dialed, accepted *net.TCPConn) {
	t.Helper()
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	d, err := net.DialTCP("tcp", nil, ln.Addr().(*net.TCPAddr))
	if err != nil {
		t.Fatal(err)
	}
	a, err := ln.AcceptTCP()
	if err != nil {
		d.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close(); a.Close() })
	return d, a
}
