package caddyktls

import (
	"context"
	"crypto/tls"
	"io"
	"net"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/mholt/caddy-l4/layer4"
	"go.uber.org/zap"

	"github.com/ktlsingress/caddy-ktls/internal/testpki"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// ktlsSessionRun runs conn through ktls_session inside a layer4 connection
// that carries a variable and a context value (standing in for caddy-l4's
// listener), and returns the connection next got.
func ktlsSessionRun(t *testing.T, conn net.Conn) (in, next *layer4.Connection) {
	t.Helper()
	in = layer4.WrapConnection(conn, nil, zap.NewNop())
	in.SetVar("earlier", "kept")
	in.Context = context.WithValue(in.Context, caddy.CtxKey("listener-like"), "kept")
	h := &KTLSSession{logger: zap.NewNop()}
	err := h.Handle(in, layer4.HandlerFunc(func(cx *layer4.Connection) error {
		next = cx
		return nil
	}))
	if err != nil || next == nil {
		t.Fatalf("ktls_session: err %v, next called: %v", err, next != nil)
	}
	return in, next
}

// A connection the ktls listener wrapper accepted: ktls_session finishes
// the handshake, records the session (tls_connection_states, {l4.tls.*})
// and passes on a connection of its own over the same wrapper connection,
// with the earlier variables and the context values the routes rely on.
func TestKTLSSessionRecordsWrapperSession(t *testing.T) {
	ca := testpki.NewCA(t, "ktls_session CA")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := tls.Dial("tcp", ln.Addr().String(), &tls.Config{RootCAs: ca.Pool, ServerName: "localhost"})
		if err == nil {
			c.Write([]byte("hello"))
			io.Copy(io.Discard, c)
			c.Close()
		}
	}()
	raw, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	server := &tls.Config{Certificates: []tls.Certificate{ca.Server(t).TLS}}
	wrapped := &stateConn{&httpConn{kc: ktls.Server(raw, server, ktls.Options{}), timeout: 10 * time.Second}}
	defer wrapped.Close()
	in, next := ktlsSessionRun(t, wrapped)
	if next == in || next.Conn != wrapped {
		t.Fatalf("next got %T (same connection: %v), want a new layer4 connection over the wrapper's", next.Conn, next == in)
	}
	states, _ := next.GetVar(layer4.TLSConnectionStatesVarName).([]*tls.ConnectionState)
	if len(states) != 1 || !states[0].HandshakeComplete || states[0].ServerName != "localhost" {
		t.Errorf("tls_connection_states %v, want the finished session", states)
	}
	if v := next.GetVar("earlier"); v != "kept" {
		t.Errorf("earlier variable %v, want kept", v)
	}
	if v := next.Context.Value(caddy.CtxKey("listener-like")); v != "kept" {
		t.Errorf("context value %v, want kept", v)
	}
	if got := next.Replacer().ReplaceAll("{l4.tls.version} {l4.tls.server_name}", "-"); got != "tls1.3 localhost" {
		t.Errorf("{l4.tls.*} placeholders: %q", got)
	}
	if vars, _ := next.Context.Value(layer4.VarsCtxKey).(map[string]any); vars[layer4.TLSConnectionStatesVarName] == nil {
		t.Error("the context's variables are not the connection's")
	}
	buf := make([]byte, 5)
	if _, err := io.ReadFull(next, buf); err != nil || string(buf) != "hello" {
		t.Errorf("read through the new connection: %q, %v", buf, err)
	}
}

// Any other connection (the HTTP port, no ktls wrapper) passes through
// unchanged.
func TestKTLSSessionPassesOtherConnections(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	in, next := ktlsSessionRun(t, a)
	if next != in || next.GetVar(layer4.TLSConnectionStatesVarName) != nil {
		t.Errorf("a plain connection came out changed: same %v, states %v", next == in, next.GetVar(layer4.TLSConnectionStatesVarName))
	}
}
