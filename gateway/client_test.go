package gateway

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward"
	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

// TestDialSignsClient: a Route's Client travels in the signed preamble, so a
// forwarder with PROXY v2 on hands the target exactly that client as the
// header's source, then the tenant's bytes.
func TestDialSignsClient(t *testing.T) {
	p := newPKI(t)
	gw := forwardtest.NewGateway(t, "gw-1")
	f := startForwarderWith(t, p, gw, "127.0.0.0/8", func(c *forward.Config) { c.ProxyProtocol = 2 })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	got := make(chan [2][]byte, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		fixed := make([]byte, 16)
		io.ReadFull(c, fixed)
		rest := make([]byte, binary.BigEndian.Uint16(fixed[14:]))
		io.ReadFull(c, rest)
		tenant, _ := io.ReadAll(c)
		got <- [2][]byte{append(fixed, rest...), tenant}
	}()
	target := ln.Addr().(*net.TCPAddr).AddrPort()
	client := ClientFrom("[::ffff:192.0.2.7]:50000", "alice")
	if client.Addr != netip.MustParseAddrPort("192.0.2.7:50000") {
		t.Fatalf("ClientFrom unmapped to %v", client.Addr)
	}
	conn, err := newDialer(t, p, gw).Dial(context.Background(), Route{Forwarder: f.addr(), Sandbox: "sbx-1", Target: target, Client: client})
	if err != nil {
		t.Fatal(err)
	}
	conn.Write([]byte("tenant bytes"))
	conn.CloseWrite()
	io.Copy(io.Discard, conn)
	conn.Close()
	var r [2][]byte
	select {
	case r = <-got:
	case <-time.After(10 * time.Second):
		t.Fatal("target saw nothing")
	}
	if want := forward.ProxyV2Header(client.Addr, target, "sbx-1", "alice"); !bytes.Equal(r[0], want) {
		t.Errorf("PROXY header\n%x\nwant\n%x", r[0], want)
	}
	if string(r[1]) != "tenant bytes" {
		t.Errorf("tenant bytes %q", r[1])
	}
}

// A client the preamble cannot carry is refused before anything is dialed.
func TestDialRefusesBadClient(t *testing.T) {
	p := newPKI(t)
	gw := forwardtest.NewGateway(t, "gw-1")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan struct{}, 1)
	go func() {
		if c, err := ln.Accept(); err == nil {
			accepted <- struct{}{}
			c.Close()
		}
	}()
	for _, c := range []preamble.ClientIdentity{
		{ID: "alice"}, // no address
		{Addr: netip.MustParseAddrPort("192.0.2.7:5"), ID: "a\x00"},
	} {
		_, err = newDialer(t, p, gw).Dial(context.Background(), Route{Forwarder: ln.Addr().String(), Sandbox: "s",
			Target: netip.MustParseAddrPort("10.0.0.7:80"), Client: c})
		var de *DialError
		if !errors.As(err, &de) || de.Step != StepPreamble || preamble.ReasonOf(err) != "bad-extension" {
			t.Errorf("client %+v: %v, want a *DialError at %s, bad-extension", c, err, StepPreamble)
		}
	}
	select {
	case <-accepted:
		t.Error("the forwarder was dialed")
	case <-time.After(100 * time.Millisecond):
	}
	if c := ClientFrom("/run/user.sock", "x"); c != (preamble.ClientIdentity{}) {
		t.Errorf("ClientFrom of a socket path: %+v", c)
	}
}
