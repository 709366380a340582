package upgrade

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/ktlsingress/caddy-ktls/internal/listensock"
)

// ServeAccepted waits, in a process that handed over, for the connections
// it accepted on its tcp-handoff listeners before the switch, until the
// last closes or the grace period ends, and says so; elsewhere it returns
// at once.
func TestServeAccepted(t *testing.T) {
	t.Cleanup(func() { handedOver.Store(false); listensock.ResumeAccepting() })
	core, logs := observer.New(zapcore.InfoLevel)
	logger := zap.New(core)
	addr, err := caddy.ParseNetworkAddress(listensock.Network + "/127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	v, err := addr.Listen(context.Background(), 0, net.ListenConfig{})
	if err != nil {
		t.Fatal(err)
	}
	ln := v.(net.Listener)
	defer ln.Close()
	client, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	server, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}

	listensock.StopAccepting()
	if left := ServeAccepted(context.Background(), logger); left != 0 || logs.Len() != 0 {
		t.Fatalf("before a handoff ended: ServeAccepted returned %d and logged %d lines; want 0 at once, nothing logged", left, logs.Len())
	}
	HandedOver()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	left := ServeAccepted(ctx, logger)
	cancel()
	if left != 1 {
		t.Errorf("at the end of the grace period ServeAccepted returned %d, want the 1 connection held", left)
	}
	if n := logs.FilterMessageSnippet("still open at the end of the grace period").Len(); n != 1 {
		t.Errorf("%d WARN lines for the connection left open, want 1", n)
	}
	done := make(chan int, 1)
	go func() { done <- ServeAccepted(context.Background(), logger) }()
	select {
	case left := <-done:
		t.Fatalf("ServeAccepted returned %d while the connection was open", left)
	case <-time.After(100 * time.Millisecond):
	}
	server.Close()
	select {
	case left := <-done:
		if left != 0 {
			t.Errorf("once the connection closed ServeAccepted returned %d, want 0", left)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("ServeAccepted did not return once the connection closed")
	}
	if n := logs.FilterMessage("served every connection accepted before the handoff").Len(); n != 1 {
		t.Errorf("%d INFO lines for the connections served, want 1", n)
	}
}
