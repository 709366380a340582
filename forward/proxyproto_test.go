package forward

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"testing"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

// proxyV2 is a PROXY v2 header as this test's own parser reads it, written
// from haproxy's proxy-protocol.txt §2.2 and sharing no code with
// ProxyV2Header.
type proxyV2 struct {
	verCmd, fam byte
	src, dst    netip.AddrPort
	tlvs        map[byte]string
	order       []byte
}

// readProxyV2 reads exactly one v2 header from r (16 fixed bytes, then the
// length they announce), never more.
func readProxyV2(r io.Reader) (proxyV2, error) {
	var h proxyV2
	fixed := make([]byte, 16)
	if _, err := io.ReadFull(r, fixed); err != nil {
		return h, err
	}
	if !bytes.Equal(fixed[:12], []byte{0x0D, 0x0A, 0x0D, 0x0A, 0x00, 0x0D, 0x0A, 0x51, 0x55, 0x49, 0x54, 0x0A}) {
		return h, fmt.Errorf("signature %x", fixed[:12])
	}
	h.verCmd, h.fam = fixed[12], fixed[13]
	rest := make([]byte, binary.BigEndian.Uint16(fixed[14:]))
	if _, err := io.ReadFull(r, rest); err != nil {
		return h, err
	}
	if h.verCmd>>4 != 2 {
		return h, fmt.Errorf("version %d", h.verCmd>>4)
	}
	var alen int
	switch h.fam {
	case 0x11:
		alen = 12
	case 0x21:
		alen = 36
	case 0x00:
	default:
		return h, fmt.Errorf("family/protocol %#x", h.fam)
	}
	if len(rest) < alen {
		return h, errors.New("address block truncated")
	}
	if alen > 0 {
		n := (alen - 4) / 2
		sa, _ := netip.AddrFromSlice(rest[:n])
		da, _ := netip.AddrFromSlice(rest[n : 2*n])
		h.src = netip.AddrPortFrom(sa, binary.BigEndian.Uint16(rest[2*n:]))
		h.dst = netip.AddrPortFrom(da, binary.BigEndian.Uint16(rest[2*n+2:]))
	}
	h.tlvs = map[byte]string{}
	for t := rest[alen:]; len(t) > 0; {
		if len(t) < 3 || len(t) < 3+int(binary.BigEndian.Uint16(t[1:])) {
			return h, errors.New("TLV truncated")
		}
		n := int(binary.BigEndian.Uint16(t[1:]))
		h.tlvs[t[0]] = string(t[3 : 3+n])
		h.order = append(h.order, t[0])
		t = t[3+n:]
	}
	return h, nil
}

// TestProxyV2HeaderBytes: the exact bytes, written out from the spec.
func TestProxyV2HeaderBytes(t *testing.T) {
	got := ProxyV2Header(netip.MustParseAddrPort("192.0.2.7:50000"), netip.MustParseAddrPort("10.1.2.3:8080"), "sbx-1", "alice")
	want, _ := hex.DecodeString("0d0a0d0a000d0a515549540a" + "21" + "11" + "001c" +
		"c0000207" + "0a010203" + "c350" + "1f90" +
		"e00005" + hex.EncodeToString([]byte("sbx-1")) + "e10005" + hex.EncodeToString([]byte("alice")))
	if !bytes.Equal(got, want) {
		t.Fatalf("header\n%x\nwant\n%x", got, want)
	}
	// Mixed families: both IPv6, the IPv4 one mapped; no identity, no 0xE1.
	h, err := readProxyV2(bytes.NewReader(ProxyV2Header(netip.MustParseAddrPort("[2001:db8::1]:443"), netip.MustParseAddrPort("10.1.2.3:8080"), "s", "")))
	if err != nil || h.fam != 0x21 || h.src != netip.MustParseAddrPort("[2001:db8::1]:443") ||
		h.dst != netip.MustParseAddrPort("[::ffff:10.1.2.3]:8080") || len(h.order) != 1 || h.tlvs[0xE0] != "s" {
		t.Fatalf("%+v %v", h, err)
	}
	// No source: UNSPEC, no address block, TLVs still there.
	h, err = readProxyV2(bytes.NewReader(ProxyV2Header(netip.AddrPort{}, netip.MustParseAddrPort("10.1.2.3:8080"), "s", "")))
	if err != nil || h.verCmd != 0x21 || h.fam != 0x00 || h.src.IsValid() || h.tlvs[0xE0] != "s" {
		t.Fatalf("%+v %v", h, err)
	}
}

// proxyTarget accepts one connection, parses the PROXY v2 header, then hashes
// every byte after it until the end of stream and replies `reply` bytes.
type proxyTarget struct {
	ln   net.Listener
	done chan proxyResult
}

type proxyResult struct {
	hdr proxyV2
	err error
	n   int64
	sum [32]byte
}

func newProxyTarget(t *testing.T, reply string) *proxyTarget {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &proxyTarget{ln: ln, done: make(chan proxyResult, 1)}
	go func() {
		c, err := ln.Accept()
		if err != nil {
			p.done <- proxyResult{err: err}
			return
		}
		defer c.Close()
		var r proxyResult
		if r.hdr, r.err = readProxyV2(c); r.err == nil {
			h := sha256.New()
			r.n, r.err = io.Copy(h, c)
			copy(r.sum[:], h.Sum(nil))
			io.WriteString(c, reply)
		}
		p.done <- r
	}()
	t.Cleanup(func() { ln.Close() })
	return p
}

func (p *proxyTarget) addr() netip.AddrPort { return p.ln.Addr().(*net.TCPAddr).AddrPort() }

// TestServeProxyProtocolV2: with ProxyProtocol 2 the target reads a v2 header
// first (source the signed client identity, or the gateway's own peer when the
// frame has none; TLVs sandbox ID and identity), then exactly the tenant's
// bytes; the tunnel's meters count the tenant's bytes alone.
func TestServeProxyProtocolV2(t *testing.T) {
	forwardtest.CheckLeaks(t)
	const size = 1 << 20
	for _, tc := range []struct {
		name    string
		ci      *preamble.ClientIdentity
		fam     byte
		wantSrc func(gw *net.TCPConn) netip.AddrPort
		wantDst func(target netip.AddrPort) netip.AddrPort
	}{
		{"identity-ipv4", &preamble.ClientIdentity{Addr: netip.MustParseAddrPort("192.0.2.7:50000"), ID: "alice@example.com"}, 0x11,
			func(*net.TCPConn) netip.AddrPort { return netip.MustParseAddrPort("192.0.2.7:50000") },
			func(a netip.AddrPort) netip.AddrPort { return a }},
		{"identity-ipv6-no-id", &preamble.ClientIdentity{Addr: netip.MustParseAddrPort("[2001:db8::7]:443")}, 0x21,
			func(*net.TCPConn) netip.AddrPort { return netip.MustParseAddrPort("[2001:db8::7]:443") },
			func(a netip.AddrPort) netip.AddrPort {
				return netip.AddrPortFrom(netip.AddrFrom16(a.Addr().As16()), a.Port())
			}},
		{"no-identity", nil, 0x11,
			func(gw *net.TCPConn) netip.AddrPort { return gw.LocalAddr().(*net.TCPAddr).AddrPort() },
			func(a netip.AddrPort) netip.AddrPort { return a }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			target := newProxyTarget(t, "pong")
			f := newFixture(t, func(c *Config) { c.ProxyProtocol = 2 })
			claims := preamble.Claims{SandboxID: "sbx-pp", Target: target.addr()}
			if tc.ci != nil {
				e, err := tc.ci.Extension()
				if err != nil {
					t.Fatal(err)
				}
				claims.Extensions = []preamble.Extension{e}
			}
			gw := f.dial(t)
			sent, recv, n := runTunnel(t, gw, f.gw.Sign(t, claims), size, 7)
			if errs := f.wait(t, 1); errs[0] != nil {
				t.Fatalf("Serve: %v", errs[0])
			}
			r := <-target.done
			if r.err != nil {
				t.Fatalf("target: %v", r.err)
			}
			if r.hdr.verCmd != 0x21 || r.hdr.fam != tc.fam {
				t.Errorf("ver/cmd %#x family %#x, want 0x21 %#x", r.hdr.verCmd, r.hdr.fam, tc.fam)
			}
			if want := tc.wantSrc(gw); r.hdr.src != want {
				t.Errorf("source %v, want %v", r.hdr.src, want)
			}
			if want := tc.wantDst(target.addr()); r.hdr.dst != want {
				t.Errorf("destination %v, want %v", r.hdr.dst, want)
			}
			wantTLVs := map[byte]string{0xE0: "sbx-pp"}
			if tc.ci != nil && tc.ci.ID != "" {
				wantTLVs[0xE1] = tc.ci.ID
			}
			if fmt.Sprint(r.hdr.tlvs) != fmt.Sprint(wantTLVs) {
				t.Errorf("TLVs %q, want %q", r.hdr.tlvs, wantTLVs)
			}
			if r.n != size || r.sum != sent {
				t.Errorf("target got %d tenant bytes (sha %x), gateway sent %d (sha %x)", r.n, r.sum, size, sent)
			}
			if n != 4 || recv != sha256.Sum256([]byte("pong")) {
				t.Errorf("gateway got %d bytes back", n)
			}
			if tun := f.res[0].Tunnel; tun.BytesToSandbox != size || tun.BytesFromSandbox != 4 {
				t.Errorf("meters: to %d from %d, want %d and 4 (the header is no tenant byte)", tun.BytesToSandbox, tun.BytesFromSandbox, size)
			}
		})
	}
}

// A malformed client identity is refused (bad-extension) before any dial:
// the target is never connected to, let alone sent a header.
func TestServeProxyProtocolMalformedIdentity(t *testing.T) {
	forwardtest.CheckLeaks(t)
	up := forwardtest.NewUpstream(t, 0)
	f := newFixture(t, func(c *Config) { c.ProxyProtocol = 2 })
	frame := f.gw.Sign(t, preamble.Claims{SandboxID: "sbx-pp", Target: up.Addr()})
	// Splice a malformed 0x0010 TLV in by hand (the signer refuses to write
	// one) and re-sign: family 5.
	frame = f.gw.WithExtensionArea(t, frame, []byte{0x00, 0x10, 0x00, 0x07, 5, 192, 0, 2, 7, 0xc3, 0x50})
	c := f.dial(t)
	c.Write(frame)
	io.Copy(io.Discard, c)
	c.Close()
	err := f.wait(t, 1)[0]
	if ReasonOf(err) != "bad-extension" || !strings.Contains(err.Error(), "client identity 0x0010: address family 5") {
		t.Fatalf("Serve: %v, want bad-extension naming the client identity", err)
	}
	up.Close()
	if up.Accepted() != 0 {
		t.Fatalf("target accepted %d connections", up.Accepted())
	}
}

func TestProxyProtocolVersionChecked(t *testing.T) {
	f := newFixture(t, nil)
	cfg := f.fwd.cfg
	cfg.ProxyProtocol = 1
	if _, err := New(cfg); err == nil || !strings.Contains(err.Error(), "ProxyProtocol 1") {
		t.Fatalf("New: %v", err)
	}
}
