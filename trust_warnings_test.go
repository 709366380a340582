package caddyktls

import (
	"context"
	"net"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/ktlsingress/caddy-ktls/modules/edgegateway"
	"github.com/ktlsingress/caddy-ktls/modules/forwarder"
	"github.com/mholt/caddy-l4/layer4"
	"github.com/mholt/caddy-l4/modules/l4proxyprotocol"
	"go.uber.org/zap"
)

// A client_id that a user chooses (a request header, the server name it
// sent) loads with exactly one WARN naming the option, the placeholders
// and the fix; one from a verified client certificate loads with none.
// Both gateway modules.
func TestClientIDFromRequestWarns(t *testing.T) {
	t.Run("sandbox transport", func(t *testing.T) {
		e := newTransportEnv(t, "10.0.0.7:80", map[string]any{"send_client": true, "client_id": "user:{http.request.header.X-User}"}, nil)
		w := e.logLines(t, edgegateway.ClientIDWarning)
		if len(w) != 1 || w[0]["level"] != "warn" || w[0]["option"] != "client_id" || w[0]["client_id"] != "user:{http.request.header.X-User}" ||
			len(w[0]["client_controlled"].([]any)) != 1 || w[0]["client_controlled"].([]any)[0] != "{http.request.header.X-User}" || w[0]["fix"] != edgegateway.ClientIDFixHTTP {
			t.Errorf("warnings %v, want one naming client_id, {http.request.header.X-User} and the fix", w)
		}
		transport := e.cfg["apps"].(map[string]any)["http"].(map[string]any)["servers"].(map[string]any)["gateway"].(map[string]any)["routes"].([]any)[0].(map[string]any)["handle"].([]any)[0].(map[string]any)["transport"].(map[string]any)
		transport["client_id"] = "{http.request.tls.client.subject}"
		e.load(t)
		if n := len(e.logLines(t, edgegateway.ClientIDWarning)); n != 1 {
			t.Errorf("%d warnings after a load with a verified certificate's subject, want the first load's 1", n)
		}
	})
	t.Run("sandbox_proxy", func(t *testing.T) {
		e := newGatewayEnv(t, map[string]any{"target": "10.0.0.7:22", "client_id": "{l4.tls.server_name}"})
		w := e.logLines(t, edgegateway.ClientIDWarning)
		if len(w) != 1 || w[0]["option"] != "client_id" || w[0]["fix"] != edgegateway.ClientIDFixL4 {
			t.Errorf("warnings %v, want one naming client_id and the fix", w)
		}
		e.proxyHandler()["client_id"] = "{l4.tls.client.subject}"
		e.load(t)
		if n := len(e.logLines(t, edgegateway.ClientIDWarning)); n != 1 {
			t.Errorf("%d warnings after a load with a verified certificate's subject, want the first load's 1", n)
		}
	})
}

// caddy-l4's proxy_protocol handler before ktls and sandbox, taking any
// peer's PROXY line, loads with one WARN per sandbox handler it precedes,
// naming where and the fix; `allow` alone changes nothing (caddy-l4 uses
// the header of a peer outside it: TestCaddyL4ProxyProtocolAllowAlone);
// allow with fallback_policy reject loads with none.
func TestProxyProtocolBeforeSandboxWarns(t *testing.T) {
	e := newSandboxConfig(t, nil)
	route := e.route()
	ktlsHandler, sandbox := route["handle"].([]any)[0], route["handle"].([]any)[1]
	pp := map[string]any{"handler": "proxy_protocol"}
	route["handle"] = []any{pp, ktlsHandler, sandbox}
	// A second route the same way, behind a subroute: each sandbox
	// handler is named once, however many walks see it.
	servers := e.cfg["apps"].(map[string]any)["layer4"].(map[string]any)["servers"].(map[string]any)
	tunnels := servers["tunnels"].(map[string]any)
	tunnels["routes"] = append(tunnels["routes"].([]any), map[string]any{"handle": []any{pp, map[string]any{"handler": "subroute",
		"routes": []any{map[string]any{"handle": []any{ktlsHandler, sandbox}}}}}})
	e.start(t)
	w := e.logLines(t, forwarder.ProxyProtocolWarning)
	want := []string{`layer4 server "tunnels", route 0, handler 2`, `layer4 server "tunnels", route 1, handler 1 (subroute), route 0, handler 1`}
	if len(w) != len(want) {
		t.Fatalf("warnings %v, want one for each of %v", w, want)
	}
	for i, l := range w {
		if l["level"] != "warn" || l["where"] != want[i] || l["fix"] != forwarder.ProxyProtocolFix {
			t.Errorf("warning %v, want where %q and the fix", l, want[i])
		}
	}
	pp["allow"] = []string{"10.0.0.0/8"}
	e.load(t)
	if n := len(e.logLines(t, forwarder.ProxyProtocolWarning)); n != 2*len(want) {
		t.Errorf("%d warnings after a load with allow alone, want %d", n, 2*len(want))
	}
	pp["fallback_policy"] = "REJECT"
	e.load(t)
	if n := len(e.logLines(t, forwarder.ProxyProtocolWarning)); n != 2*len(want) {
		t.Errorf("%d warnings after a load with allow and fallback_policy reject, want none new", n-2*len(want))
	}
}

// What TestProxyProtocolBeforeSandboxWarns relies on, pinned: caddy-l4's
// proxy_protocol handler with `allow` alone uses the PROXY header of a
// peer outside allow (127.0.0.1, allow 10.0.0.0/8): the address the
// handlers after it see is the one the peer wrote. With fallback_policy
// reject the peer keeps its own address and its PROXY line stays unread.
func TestCaddyL4ProxyProtocolAllowAlone(t *testing.T) {
	for _, tc := range []struct {
		fallback, remote, read string
	}{
		{"", "203.0.113.9:5555", "hello"},
		{"REJECT", "127.0.0.1", "PROXY"},
	} {
		h := &l4proxyprotocol.Handler{Allow: []string{"10.0.0.0/8"}}
		if tc.fallback != "" {
			if err := h.FallbackPolicy.UnmarshalText([]byte(tc.fallback)); err != nil {
				t.Fatal(err)
			}
		}
		ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
		if err := h.Provision(ctx); err != nil {
			t.Fatal(err)
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			c, err := net.Dial("tcp", ln.Addr().String())
			if err == nil {
				c.Write([]byte("PROXY TCP4 203.0.113.9 127.0.0.1 5555 443\r\nhello"))
				c.Close()
			}
		}()
		c, err := ln.Accept()
		if err != nil {
			t.Fatal(err)
		}
		var remote, read string
		h.Handle(layer4.WrapConnection(c, nil, zap.NewNop()), layer4.HandlerFunc(func(cx *layer4.Connection) error {
			b := make([]byte, 5)
			n, _ := cx.Read(b)
			remote, read = cx.RemoteAddr().String(), string(b[:n])
			return nil
		}))
		if host, _, _ := net.SplitHostPort(remote); remote != tc.remote && host != tc.remote || read != tc.read {
			t.Errorf("fallback_policy %q: the next handler saw peer %s and read %q, want %s and %q", tc.fallback, remote, read, tc.remote, tc.read)
		}
		c.Close()
		ln.Close()
		cancel()
	}
}
