package forwardtest

import (
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
)

// HeldRelay is a TCP relay that accepts connections and holds each until
// Release is closed, then relays it to Target: a forwarder whose answer
// is late, for a test that needs a dial to wait. It copies through
// userspace (Go's splice would keep pipes in its pool past a leak check).
// It stops at test cleanup.
type HeldRelay struct {
	ln       net.Listener
	Target   string        // set before the first connection
	Release  chan struct{} // closed: the held connections go on
	Accepted atomic.Int32  // connections accepted so far
}

// NewHeldRelay listens on a loopback port.
func NewHeldRelay(t testing.TB) *HeldRelay {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	h := &HeldRelay{ln: ln, Release: make(chan struct{})}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			h.Accepted.Add(1)
			wg.Go(func() {
				defer c.Close()
				select {
				case <-h.Release:
				case <-stop:
					return
				}
				up, err := net.Dial("tcp", h.Target)
				if err != nil {
					return
				}
				defer up.Close()
				go func() {
					io.Copy(struct{ io.Writer }{up}, struct{ io.Reader }{c})
					up.(*net.TCPConn).CloseWrite()
				}()
				io.Copy(struct{ io.Writer }{c}, struct{ io.Reader }{up})
			})
		}
	})
	t.Cleanup(func() { ln.Close(); close(stop); wg.Wait() })
	return h
}

// Addr is the relay's address.
func (h *HeldRelay) Addr() string { return h.ln.Addr().String() }
