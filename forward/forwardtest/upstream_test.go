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
