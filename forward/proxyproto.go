package forward

import (
	"encoding/binary"
	"net"
	"net/netip"
)

// PROXY protocol version 2 (haproxy's proxy-protocol.txt, section 2.2), as the
// forwarder writes it to a target before any tenant byte when
// Config.ProxyProtocol is 2.
const (
	// ProxyV2Signature opens every version 2 header.
	ProxyV2Signature = "\r\n\r\n\x00\r\nQUIT\n"
	// PP2TypeSandboxID is the TLV (custom range 0xE0-0xEF) that carries the
	// sandbox ID the signed preamble named.
	PP2TypeSandboxID = 0xE0
	// PP2TypeClientID is the TLV that carries the identity string of the
	// preamble's client identity extension, when it has one.
	PP2TypeClientID = 0xE1

	proxyV2VerCmdProxy = 0x21 // version 2, command PROXY
	proxyV2Unspec      = 0x00 // AF_UNSPEC, UNSPEC
	proxyV2TCP4        = 0x11 // AF_INET, STREAM
	proxyV2TCP6        = 0x21 // AF_INET6, STREAM
)

// ProxyV2Header returns a PROXY protocol v2 header with command PROXY: the
// connection came from src and was for dst, over TCP, followed by the TLVs
// PP2TypeSandboxID (sandboxID) and, when clientID is not empty,
// PP2TypeClientID. When src and dst are of different families both are
// written as IPv6 (an IPv4 address IPv4-mapped); when src is not valid the
// address family is UNSPEC (no addresses; the receiver uses the
// connection's own). sandboxID and clientID are short (the preamble bounds
// them to 128 and 255 bytes), so the header always fits its 16-bit length.
func ProxyV2Header(src, dst netip.AddrPort, sandboxID, clientID string) []byte {
	var fam byte
	var addrs []byte
	switch {
	case !src.IsValid() || !dst.IsValid():
		fam = proxyV2Unspec
	case src.Addr().Is4() && dst.Addr().Is4():
		fam = proxyV2TCP4
		a, b := src.Addr().As4(), dst.Addr().As4()
		addrs = append(append(addrs, a[:]...), b[:]...)
	default:
		fam = proxyV2TCP6
		a, b := src.Addr().As16(), dst.Addr().As16()
		addrs = append(append(addrs, a[:]...), b[:]...)
	}
	if fam != proxyV2Unspec {
		addrs = binary.BigEndian.AppendUint16(addrs, src.Port())
		addrs = binary.BigEndian.AppendUint16(addrs, dst.Port())
	}
	tlvs := appendPP2TLV(nil, PP2TypeSandboxID, sandboxID)
	if clientID != "" {
		tlvs = appendPP2TLV(tlvs, PP2TypeClientID, clientID)
	}
	h := make([]byte, 0, 16+len(addrs)+len(tlvs))
	h = append(h, ProxyV2Signature...)
	h = append(h, proxyV2VerCmdProxy, fam)
	h = binary.BigEndian.AppendUint16(h, uint16(len(addrs)+len(tlvs)))
	h = append(h, addrs...)
	return append(h, tlvs...)
}

func appendPP2TLV(b []byte, typ byte, v string) []byte {
	b = append(b, typ)
	b = binary.BigEndian.AppendUint16(b, uint16(len(v)))
	return append(b, v...)
}

// peerAddrPort is the gateway connection's own peer, the PROXY source of a
// frame without a client identity: the TCP remote address of conn, else
// peer parsed as ip:port; invalid when neither names one.
func peerAddrPort(conn net.Conn, peer string) netip.AddrPort {
	if conn != nil {
		if ta, ok := conn.RemoteAddr().(*net.TCPAddr); ok {
			ap := ta.AddrPort()
			return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
		}
	}
	ap, _ := netip.ParseAddrPort(peer)
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
}
