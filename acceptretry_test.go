package caddyktls

import (
	"context"
	"io"
	"net"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// The binary has the tcp-retry and tcp-handoff networks (acceptretry.go
// imports them): an address of each listens through Caddy and accepts.
func TestRetryNetworks(t *testing.T) {
	for _, network := range []string{"tcp-retry", "tcp-handoff"} {
		na, err := caddy.ParseNetworkAddress(network + "/127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		got, err := na.Listen(context.Background(), 0, net.ListenConfig{})
		if err != nil {
			t.Fatalf("%s: %v", network, err)
		}
		ln := got.(net.Listener)
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		s, err := ln.Accept()
		if err != nil {
			t.Fatalf("%s: Accept: %v", network, err)
		}
		c.Write([]byte("x"))
		c.Close()
		if b, err := io.ReadAll(s); string(b) != "x" || err != nil {
			t.Errorf("%s: read %q, %v; want x", network, b, err)
		}
		s.Close()
		ln.Close()
	}
}
