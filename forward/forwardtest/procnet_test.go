package forwardtest

import (
	"os"
	"strings"
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

// ProcNetAddr decodes both forms /proc/net/tcp{,6} write, and
// QueuedSockets lists a connection that holds unread bytes, by its
// decoded addresses, and none that holds nothing.
func TestQueuedSockets(t *testing.T) {
	for in, want := range map[string]string{
		"0100007F:1F90":                         "127.0.0.1:8080",
		"00000000000000000000000001000000:0050": "[::1]:80",
	} {
		if got := ProcNetAddr(t, in); got != want {
			t.Errorf("ProcNetAddr(%q) = %q, want %q", in, got, want)
		}
	}
	d, a := TCPPair(t)
	read := func() string {
		data, err := os.ReadFile("/proc/net/tcp")
		if err != nil {
			t.Fatal(err)
		}
		return QueuedSockets(t, data)
	}
	line := a.LocalAddr().String() + " " + a.RemoteAddr().String() + " st 01 tx:rx "
	if strings.Contains(read(), line) {
		t.Fatalf("an idle connection is listed as holding bytes: %s", read())
	}
	if _, err := d.Write([]byte("held")); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(read(), line+"00000000:00000004"); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("4 unread bytes at %s are not listed: %s", a.LocalAddr(), read())
		}
	}
}
