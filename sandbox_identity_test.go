package caddyktls

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward"
	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/modules/edgegateway"
	"github.com/ktlsingress/caddy-ktls/modules/forwarder"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

// proxyTarget is a sandbox service behind a forwarder with proxy_protocol
// v2: it reads the PROXY v2 header (16 fixed bytes and the length they
// announce), then hashes the tenant's bytes to their end and answers "ok".
type proxyTarget struct {
	ln  net.Listener
	got chan proxySeen
}

type proxySeen struct {
	header []byte
	n      int64
	sum    [32]byte
}

func newProxyTarget(t *testing.T) *proxyTarget {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &proxyTarget{ln: ln, got: make(chan proxySeen, 4)}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				var s proxySeen
				fixed := make([]byte, 16)
				if _, err := io.ReadFull(c, fixed); err != nil {
					p.got <- s
					return
				}
				rest := make([]byte, binary.BigEndian.Uint16(fixed[14:]))
				io.ReadFull(c, rest)
				s.header = append(fixed, rest...)
				h := sha256.New()
				s.n, _ = io.Copy(h, c)
				copy(s.sum[:], h.Sum(nil))
				io.WriteString(c, "ok")
				p.got <- s
			}()
		}
	}()
	t.Cleanup(func() { ln.Close() })
	return p
}

func (p *proxyTarget) addr() netip.AddrPort { return p.ln.Addr().(*net.TCPAddr).AddrPort() }

// The client's identity, signed, to the sandbox: a user's TLS session goes
// through the gateway's sandbox_proxy (which signs the user's address and,
// from client_id, the server name they asked for) and a forwarder with
// proxy_protocol v2; the target reads a PROXY v2 header whose source is the
// user's own address, with the sandbox ID and the identity as TLVs, then
// exactly the user's bytes.
func TestSandboxProxyClientIdentity(t *testing.T) { sandboxProxyClientIdentity(t, false) }

// TestKernelSandboxProxyClientIdentity is TestSandboxProxyClientIdentity on
// kernel TLS (the header is a plain write on the target's socket; the
// tenant's bytes are still spliced).
func TestKernelSandboxProxyClientIdentity(t *testing.T) {
	kerneltest.Require(t)
	sandboxProxyClientIdentity(t, true)
}

func sandboxProxyClientIdentity(t *testing.T, _ bool) {
	const size = 4 << 20
	target := newProxyTarget(t)
	sandbox := uniqueSandbox("sbx-id")
	e := newGatewayEnvFull(t, map[string]any{"proxy_protocol": "v2"},
		map[string]any{"target": target.addr().String(), "client_id": "{l4.tls.server_name}"})
	user := e.userDial(t, sandbox)
	userAddr := user.LocalAddr().(*net.TCPAddr).AddrPort()
	n, recvSum, err := transfer(user, size, 9)
	if err != nil {
		t.Fatalf("transfer: %v", err)
	}
	var s proxySeen
	select {
	case s = <-target.got:
	case <-time.After(20 * time.Second):
		t.Fatal("the target saw nothing")
	}
	want := forward.ProxyV2Header(userAddr, target.addr(), sandbox, sandbox+".sandbox.test")
	if !bytes.Equal(s.header, want) {
		t.Errorf("PROXY header\n%x\nwant (source %s, TLVs %s and %s.sandbox.test)\n%x", s.header, userAddr, sandbox, sandbox, want)
	}
	if s.n != size || s.sum != forwardtest.PatternSum(9, size) {
		t.Errorf("target got %d tenant bytes (sum match %v), want %d", s.n, s.sum == forwardtest.PatternSum(9, size), size)
	}
	if n != 2 || recvSum != sha256.Sum256([]byte("ok")) {
		t.Errorf("user got %d bytes back, want \"ok\"", n)
	}
	var act sandboxTotals
	waitUntil(t, 10*time.Second, func() bool {
		act = activityOf(t, e.sandboxEnv, sandbox)
		return act.TotalTunnels == 1 && act.OpenTunnels == 0
	}, "the tunnel to end")
	if act.BytesToSandbox != size || act.BytesFromSandbox != 2 {
		t.Errorf("activity %+v: want %d bytes to the sandbox and 2 from it (the header is no tenant byte)", act, size)
	}
}

// A frame whose client identity is malformed is refused bad-extension, its
// reason logged and counted, and nothing reaches the target: not a header,
// not a connection.
func TestSandboxMalformedClientIdentity(t *testing.T) { sandboxMalformedClientIdentity(t, false) }

func TestKernelSandboxMalformedClientIdentity(t *testing.T) {
	kerneltest.Require(t)
	sandboxMalformedClientIdentity(t, true)
}

func sandboxMalformedClientIdentity(t *testing.T, kernel bool) {
	up := forwardtest.NewUpstream(t, 0)
	e := newSandboxEnv(t, map[string]any{"proxy_protocol": "v2"})
	before := forwarder.Tunnels().RefusedTunnels()["bad-extension"]
	logged := len(e.logLines(t, rejectedMsg))
	frame := e.gw.Sign(t, preamble.Claims{SandboxID: "sbx-bad-id", Target: up.Addr()})
	// Client 192.0.2.7:50000 with an identity holding a newline.
	frame = e.gw.WithExtensionArea(t, frame, append([]byte{0x00, 0x10, 0x00, 0x0a, 4, 192, 0, 2, 7, 0xc3, 0x50}, "a\nb"...))
	c := e.rawTunnel(t, frame, false)
	defer c.Close()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	n, err := io.Copy(io.Discard, c)
	if n != 0 {
		t.Errorf("refused client read %d bytes", n)
	}
	checkGatewayEnd(t, err, kernel, true)
	waitRejections(t, "bad-extension", before+1)
	l := e.waitLogLine(t, rejectedMsg, logged)
	if l["reason"] != "bad-extension" || !strings.Contains(l["error"].(string), "client identity 0x0010: identity \"a\\nb\" holds control character U+000A") {
		t.Errorf("log line %v: want reason bad-extension naming the client identity's control character", l)
	}
	up.Close()
	if up.Accepted() != 0 {
		t.Errorf("the target was dialed %d times", up.Accepted())
	}
}

// proxyListener accepts connections that open with a PROXY v2 header and
// hands them on with the header's source and 0xE1 TLV readable per
// connection (proxyConn).
type proxyListener struct {
	net.Listener
	accepted atomic.Int64
}

type proxyConn struct {
	net.Conn
	src, id string
}

func (l *proxyListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	l.accepted.Add(1)
	fixed := make([]byte, 16)
	if _, err := io.ReadFull(c, fixed); err != nil {
		return &proxyConn{Conn: c}, nil
	}
	rest := make([]byte, binary.BigEndian.Uint16(fixed[14:]))
	io.ReadFull(c, rest)
	pc := &proxyConn{Conn: c}
	if fixed[13] == 0x11 && len(rest) >= 12 {
		a, _ := netip.AddrFromSlice(rest[0:4])
		pc.src = netip.AddrPortFrom(a, binary.BigEndian.Uint16(rest[8:])).String()
		for tl := rest[12:]; len(tl) >= 3; {
			n := int(binary.BigEndian.Uint16(tl[1:]))
			if len(tl) < 3+n {
				break
			}
			if tl[0] == 0xE1 {
				pc.id = string(tl[3 : 3+n])
			}
			tl = tl[3+n:]
		}
	}
	return pc, nil
}

// The sandbox transport with send_client: each request's client address
// (and X-User, through client_id) reaches the app in the PROXY header of the
// tunnel that carried it; requests of one user connection share a tunnel,
// two users never do.
func TestSandboxTransportSendClient(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	pl := &proxyListener{Listener: ln}
	type ctxKey struct{}
	srv := &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			pc := r.Context().Value(ctxKey{}).(*proxyConn)
			w.Header().Set("X-Proxy-Src", pc.src)
			w.Header().Set("X-Proxy-Id", pc.id)
		}),
		ConnContext: func(ctx context.Context, c net.Conn) context.Context { return context.WithValue(ctx, ctxKey{}, c) },
	}
	go srv.Serve(pl)
	t.Cleanup(func() { srv.Close() })
	e := newTransportEnvWith(t, ln.Addr().String(), func(_, sandbox map[string]any) map[string]any {
		sandbox["proxy_protocol"] = "v2"
		return nil
	}, map[string]any{"send_client": true, "client_id": "{http.request.header.X-User}"})
	sandbox := uniqueSandbox("sbx-tr-id")
	for _, user := range []string{"alice", "bob"} {
		var local atomic.Value
		c := e.user(false)
		c.Transport.(*http.Transport).DialContext = func(ctx context.Context, network, _ string) (net.Conn, error) {
			conn, err := (&net.Dialer{}).DialContext(ctx, network, e.siteAddr)
			if err == nil {
				local.Store(conn.LocalAddr().String())
			}
			return conn, err
		}
		for range 2 {
			req, _ := http.NewRequest("GET", siteURL(sandbox, "/"), nil)
			req.Header.Set("X-User", user)
			resp, err := c.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 || resp.Header.Get("X-Proxy-Src") != local.Load() || resp.Header.Get("X-Proxy-Id") != user {
				t.Errorf("%s: status %d, PROXY source %q identity %q; want %v and %q", user, resp.StatusCode,
					resp.Header.Get("X-Proxy-Src"), resp.Header.Get("X-Proxy-Id"), local.Load(), user)
			}
		}
		c.CloseIdleConnections()
	}
	if n := pl.accepted.Load(); n != 2 {
		t.Errorf("the app accepted %d tunnels, want 2 (one per user connection)", n)
	}
}

func TestSandboxTransportClientIDNeedsSendClient(t *testing.T) {
	err := (&edgegateway.Transport{Sandbox: "s", Target: "10.0.0.1:80", ClientID: "{http.request.header.X-User}"}).Validate()
	if err == nil || err.Error() != "sandbox transport: client_id needs send_client: the identity travels with the client's address" {
		t.Fatalf("Validate: %v", err)
	}
}
