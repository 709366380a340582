package splicetest

import (
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"
)

// A past write deadline refuses the half-close with nothing sent; once it
// is cleared, the half-close reaches the peer as EOF.
func TestRecordCloser(t *testing.T) {
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	d, err := net.DialTCP("tcp", nil, ln.Addr().(*net.TCPAddr))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	a, err := ln.AcceptTCP()
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	c := RecordCloser{d}
	if _, ok := c.SpliceSink(); !ok {
		t.Fatal("SpliceSink: no socket")
	}
	c.SetWriteDeadline(time.Unix(1, 0))
	if err := c.CloseWrite(); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("CloseWrite past the deadline: %v, want os.ErrDeadlineExceeded", err)
	}
	a.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	if _, err := a.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("the peer after the refused half-close: %v, want nothing (its read deadline)", err)
	}
	c.SetWriteDeadline(time.Time{})
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	a.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := a.Read(make([]byte, 1)); n != 0 || err != io.EOF {
		t.Fatalf("the peer after the half-close: %d, %v; want EOF", n, err)
	}
}
