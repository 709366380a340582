package forwardtest

import (
	"errors"
	"io"
	"net"
	"syscall"
	"testing"
)

// Close serves every connection whose dial completed before it, even one
// the listener had not accepted yet and whose client has already reset
// it: a tunnel cut at once still leaves its Result. The upstream here has
// no accept loop, so every connection is still queued when Close runs.
func TestUpstreamCloseTakesQueuedConnections(t *testing.T) {
	const n = 16
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	up := &Upstream{ln: l.(*net.TCPListener), reply: func(int, <-chan struct{}) io.Reader { return io.LimitReader(NewPattern(2), 0) }}
	for i := range n {
		c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(up.Addr()))
		if err != nil {
			t.Fatal(err)
		}
		if i%2 == 0 {
			c.SetLinger(0) // a reset, as a forwarder cuts a truncated tunnel
		} else {
			c.Write([]byte("request"))
		}
		c.Close()
	}
	up.Close()
	results := up.Results()
	if len(results) != n || up.Accepted() != n {
		t.Fatalf("%d results, %d accepted, for %d connections dialed before Close", len(results), up.Accepted(), n)
	}
	var resets, requests int
	for _, r := range results {
		switch {
		case r.Received == int64(len("request")) && r.ReadErr == nil:
			requests++
		case r.Received == 0 && r.ReadErr != nil && errors.Is(r.ReadErr, syscall.ECONNRESET):
			resets++
		}
	}
	if resets != n/2 || requests != n/2 {
		t.Errorf("%d resets and %d whole requests read, want %d each: %+v", resets, requests, n/2, results)
	}
	up.Close() // a second Close takes nothing and waits for nothing
}

// A closed port refuses connections and no listener can take it while the
// test runs.
func TestClosedPortStaysClosed(t *testing.T) {
	a := ClosedPort(t)
	if c, err := net.Dial("tcp", a.String()); !errors.Is(err, syscall.ECONNREFUSED) {
		if err == nil {
			c.Close()
		}
		t.Fatalf("dial %s: %v, want the connection refused", a, err)
	}
	if l, err := net.Listen("tcp", a.String()); !errors.Is(err, syscall.EADDRINUSE) {
		if err == nil {
			l.Close()
		}
		t.Fatalf("listen on %s: %v, want the address in use", a, err)
	}
}

// An upstream on a closed port listens on it: the sandbox wakes.
func TestUpstreamOnClosedPort(t *testing.T) {
	a := ClosedPort(t)
	up := NewUpstreamOn(t, a.String(), 5)
	if up.Addr() != a {
		t.Fatalf("upstream on %s, want %s", up.Addr(), a)
	}
	c, err := net.Dial("tcp", a.String())
	if err != nil {
		t.Fatal(err)
	}
	c.(*net.TCPConn).CloseWrite()
	b, err := io.ReadAll(c)
	c.Close()
	if len(b) != 5 || err != nil {
		t.Errorf("read %d bytes, %v: want the upstream's 5", len(b), err)
	}
}
