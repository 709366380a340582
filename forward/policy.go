package forward

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
)

// TargetPolicy decides which ip:port targets a verified preamble may name.
//
// A target must lie in one of the allowed prefixes (all addresses when none
// are given) and use one of the allowed ports (all ports when none are
// given). Independently of that, some addresses are refused by default
// because a tunnel to them reaches the forwarder's own host or its cloud
// metadata service rather than a sandbox: loopback, link-local (which holds
// 169.254.169.254), multicast, unspecified, limited broadcast, and every
// address of the host's own interfaces. Such an address is opened only by an
// allowed prefix that lies entirely inside the refused range (or equals the
// interface address): "127.0.0.0/8" or "127.0.0.1/32" open loopback for a
// demo, while "0.0.0.0/0" or "::/0" never do.
//
// An address in a NAT64 prefix, the well-known 64:ff9b::/96 (RFC 6052) or
// the local-use 64:ff9b:1::/48 (RFC 8215), reaches the IPv4 address it
// embeds through a translator, so it is also judged by that IPv4 address
// against the refused ranges, exactly as the IPv4 address itself is:
// 64:ff9b::a9fe:a9fe is refused as 169.254.169.254 is, even when an allowed
// prefix such as 64:ff9b::/96 contains it, and only an allowed IPv4 prefix
// inside the refused range opens it. (The allowed prefixes apply to the
// address as written: allowing 64:ff9b::/96 allows what NAT64 reaches.)
type TargetPolicy struct {
	allow []netip.Prefix
	ports []portRange
	// refused holds the default-denied ranges; refusedNames names each for
	// error messages.
	refused      []netip.Prefix
	refusedNames []string
}

type portRange struct{ lo, hi uint16 }

// NewTargetPolicy builds a policy from CIDR prefixes (or bare addresses) and
// ports or port ranges ("5432", "8000-8999"). Interface addresses are read
// once, now: addresses added to the host later are not refused by default.
func NewTargetPolicy(allowCIDRs, allowPorts []string) (*TargetPolicy, error) {
	p := &TargetPolicy{}
	for _, s := range allowCIDRs {
		pfx, err := parsePrefix(s)
		if err != nil {
			return nil, err
		}
		p.allow = append(p.allow, pfx)
	}
	for _, s := range allowPorts {
		r, err := parsePortRange(s)
		if err != nil {
			return nil, err
		}
		p.ports = append(p.ports, r)
	}
	for _, d := range defaultRefused {
		p.refused = append(p.refused, netip.MustParsePrefix(d.cidr))
		p.refusedNames = append(p.refusedNames, d.name)
	}
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil, fmt.Errorf("target policy: list interface addresses: %w", err)
	}
	for _, a := range addrs {
		ipn, ok := a.(*net.IPNet)
		if !ok {
			continue
		}
		ip, ok := netip.AddrFromSlice(ipn.IP)
		if !ok {
			continue
		}
		ip = ip.Unmap()
		if ip.IsLoopback() || ip.IsLinkLocalUnicast() {
			continue // already refused as a range, and opened as a range
		}
		p.refused = append(p.refused, netip.PrefixFrom(ip, ip.BitLen()))
		p.refusedNames = append(p.refusedNames, "host interface address")
	}
	return p, nil
}

var defaultRefused = []struct{ cidr, name string }{
	{"127.0.0.0/8", "loopback"},
	{"::1/128", "loopback"},
	{"169.254.0.0/16", "link-local (cloud metadata)"},
	{"fe80::/10", "link-local"},
	{"224.0.0.0/4", "multicast"},
	{"ff00::/8", "multicast"},
	{"0.0.0.0/8", "unspecified"},
	{"::/128", "unspecified"},
	{"255.255.255.255/32", "broadcast"},
}

func parsePrefix(s string) (netip.Prefix, error) {
	s = strings.TrimSpace(s)
	if !strings.Contains(s, "/") {
		a, err := netip.ParseAddr(s)
		if err != nil {
			return netip.Prefix{}, fmt.Errorf("target policy: %q is neither a CIDR prefix nor an IP address", s)
		}
		a = a.Unmap()
		return netip.PrefixFrom(a, a.BitLen()), nil
	}
	pfx, err := netip.ParsePrefix(s)
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("target policy: bad CIDR prefix %q: %v", s, err)
	}
	if pfx.Addr().Is4In6() {
		return netip.Prefix{}, fmt.Errorf("target policy: write IPv4 prefix %q in IPv4 form", s)
	}
	return pfx.Masked(), nil
}

func parsePortRange(s string) (portRange, error) {
	lo, hi, isRange := strings.Cut(strings.TrimSpace(s), "-")
	l, err := strconv.ParseUint(lo, 10, 16)
	if err != nil || l == 0 {
		return portRange{}, fmt.Errorf("target policy: bad port %q (want 1-65535 or a range lo-hi)", s)
	}
	if !isRange {
		return portRange{uint16(l), uint16(l)}, nil
	}
	h, err := strconv.ParseUint(hi, 10, 16)
	if err != nil || h < l {
		return portRange{}, fmt.Errorf("target policy: bad port range %q (want lo-hi with lo <= hi)", s)
	}
	return portRange{uint16(l), uint16(h)}, nil
}

// ErrTargetDenied is wrapped by every error Check returns.
var ErrTargetDenied = errors.New("target not allowed")

// Check returns nil when target may be dialed, or an error wrapping
// ErrTargetDenied that says which rule refused it.
func (p *TargetPolicy) Check(target netip.AddrPort) error {
	addr := target.Addr().Unmap()
	if !addr.IsValid() {
		return fmt.Errorf("%w: invalid address", ErrTargetDenied)
	}
	if len(p.ports) > 0 && !p.portAllowed(target.Port()) {
		return fmt.Errorf("%w: port %d is not in the allowed ports", ErrTargetDenied, target.Port())
	}
	if len(p.allow) > 0 && !p.inAllow(addr, netip.Prefix{}) {
		return fmt.Errorf("%w: %s is not in the allowed prefixes", ErrTargetDenied, addr)
	}
	if i, ok := p.refusedRange(addr); ok {
		return fmt.Errorf("%w: %s is %s, refused unless an allowed prefix inside %s names it", ErrTargetDenied, addr, p.refusedNames[i], p.refused[i])
	}
	for _, v4 := range nat64Embedded(addr) {
		if i, ok := p.refusedRange(v4); ok {
			return fmt.Errorf("%w: %s is NAT64 for %s, which is %s, refused unless an allowed prefix inside %s names it",
				ErrTargetDenied, addr, v4, p.refusedNames[i], p.refused[i])
		}
	}
	return nil
}

// refusedRange returns the index of a default-refused range that holds addr
// and that no allowed prefix inside it opens.
func (p *TargetPolicy) refusedRange(addr netip.Addr) (int, bool) {
	for i, r := range p.refused {
		if r.Contains(addr) && !p.inAllow(addr, r) {
			return i, true
		}
	}
	return 0, false
}

// The NAT64 prefixes whose addresses stand for IPv4 addresses.
var (
	nat64WellKnown = netip.MustParsePrefix("64:ff9b::/96")   // RFC 6052: IPv4 in the last 32 bits
	nat64LocalUse  = netip.MustParsePrefix("64:ff9b:1::/48") // RFC 8215: the operator's prefix, /48 to /96, lies inside
)

// nat64Embedded returns the IPv4 addresses that addr, in a NAT64 prefix,
// may translate to; nil outside them. For 64:ff9b::/96 that is its last 32
// bits. Inside 64:ff9b:1::/48 the translator's prefix length is the
// operator's choice (48, 56, 64 or 96, RFC 6052 §2.2), which the forwarder
// cannot know, so it returns the /96 reading (the last 32 bits) first and
// then the IPv4 address of every other layout addr is well-formed for (bits
// 64-71 and the suffix after the IPv4 address zero); the address is refused
// if any of them is. A well-formed /48 or /56 address has a /96 reading of
// 0.0.0.0, which is refused: inside 64:ff9b:1::/48 use /96 (or /64)
// translation prefixes.
func nat64Embedded(addr netip.Addr) []netip.Addr {
	switch {
	case nat64WellKnown.Contains(addr):
		b := addr.As16()
		return []netip.Addr{netip.AddrFrom4([4]byte(b[12:16]))}
	case !nat64LocalUse.Contains(addr):
		return nil
	}
	b := addr.As16()
	out := []netip.Addr{netip.AddrFrom4([4]byte(b[12:16]))}
	if b[8] != 0 {
		return out
	}
	// RFC 6052 layouts: the IPv4 bytes skip byte 8 (bits 64-71); bytes
	// after the IPv4 address are the suffix.
	for _, layout := range []struct {
		v4         [4]int
		suffixFrom int
	}{
		{[4]int{6, 7, 9, 10}, 11},   // /48
		{[4]int{7, 9, 10, 11}, 12},  // /56
		{[4]int{9, 10, 11, 12}, 13}, // /64
	} {
		if !allZero(b[layout.suffixFrom:]) {
			continue
		}
		out = append(out, netip.AddrFrom4([4]byte{b[layout.v4[0]], b[layout.v4[1]], b[layout.v4[2]], b[layout.v4[3]]}))
	}
	return out
}

func allZero(b []byte) bool {
	for _, x := range b {
		if x != 0 {
			return false
		}
	}
	return true
}

func (p *TargetPolicy) portAllowed(port uint16) bool {
	for _, r := range p.ports {
		if r.lo <= port && port <= r.hi {
			return true
		}
	}
	return false
}

// inAllow reports whether an allowed prefix contains addr and, when within
// is valid, lies entirely inside within (so that a wide allow such as
// 0.0.0.0/0 never opens a refused range).
func (p *TargetPolicy) inAllow(addr netip.Addr, within netip.Prefix) bool {
	for _, a := range p.allow {
		if !a.Contains(addr) {
			continue
		}
		if !within.IsValid() || (a.Bits() >= within.Bits() && within.Contains(a.Addr())) {
			return true
		}
	}
	return false
}
