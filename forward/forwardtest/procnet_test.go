package forwardtest

import (
	"testing"
	"time"
)

// Established finds a live loopback connection, from either end, and
// loses it once it was reset.
func TestEstablished(t *testing.T) {
	d, a := TCPPair(t)
	if !Established(t, d.LocalAddr().String(), d.RemoteAddr().String()) || !Established(t, a.LocalAddr().String(), a.RemoteAddr().String()) {
		t.Fatal("a live connection is not ESTABLISHED in /proc/net/tcp")
	}
	a.SetLinger(0)
	a.Close()
	for deadline := time.Now().Add(10 * time.Second); Established(t, d.LocalAddr().String(), d.RemoteAddr().String()); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("a reset connection is still ESTABLISHED")
		}
	}
}
