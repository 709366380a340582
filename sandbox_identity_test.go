package caddyktls

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"io"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward"
	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
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
	before := tunnels.Rejections()["bad-extension"]
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
