package splice

import (
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"
	"testing"
	"time"
)

// socketError replaces only a "not pollable" error, and only with the
// socket's pending error: a reset still pending on the socket comes back as
// ECONNRESET, also through NetConn; nil, io.EOF and other errors, and a
// "not pollable" on a socket with no pending error, come back unchanged.
func TestSocketError(t *testing.T) {
	notPollable := &net.OpError{Op: "read", Net: "tcp", Err: errors.New("not pollable")}
	reset, resetter := tcpPair(t)
	healthy, _ := tcpPair(t)
	// The peer resets the connection; nothing reads it, so the reset stays
	// the socket's pending error once the connection is closed.
	resetClose(t, resetter)
	waitTCPClose(t, reset)
	for _, err := range []error{nil, io.EOF, syscall.EPIPE} {
		if got := socketError(reset, err); got != err {
			t.Errorf("socketError(%v) = %v, want it unchanged", err, got)
		}
	}
	if got := socketError(healthy, notPollable); got != notPollable {
		t.Errorf("not pollable, no pending error: %v, want it unchanged", got)
	}
	if got := socketError(opaqueConn{reset}, fmt.Errorf("source: %w", notPollable)); !errors.Is(got, syscall.ECONNRESET) {
		t.Errorf("not pollable on a reset socket: %v, want ECONNRESET", got)
	}
}

// waitTCPClose waits until the kernel has closed c's connection (a reset
// arrived), without reading c.
func waitTCPClose(t *testing.T, c *net.TCPConn) {
	for deadline := time.Now().Add(5 * time.Second); !wasReset(c); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the connection is not closed 5 s after the peer's reset")
		}
	}
}
