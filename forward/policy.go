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
// An address that stands for an IPv4 address, because a translator or a
// tunnel between the forwarder and the target turns it into one, is also
// judged by every IPv4 address it may reach, against the refused ranges,
// exactly as the IPv4 address itself is; it is refused if any of them is.
// Such addresses (embeddedIPv4 reads them):
//
//   - NAT64, RFC 6052 §2.2: the well-known prefix 64:ff9b::/96 (IPv4 in bits
//     96-127); the local-use prefix 64:ff9b:1::/48 (RFC 8215), inside which
//     the operator's translator prefix may be /48, /56, /64 or /96 and the
//     forwarder cannot know which, so an address there is judged by all
//     four readings; and the prefixes the operator declares
//     (NewTargetPolicy's nat64Prefixes, /32, /40, /48, /56, /64 or /96),
//     each judged by its own length's reading alone. The IPv4 address skips
//     bits 64-71, the "u" octet, which RFC 6052 requires to be zero: an
//     address whose u octet is not zero is refused (in 64:ff9b:1::/48 the
//     preamble refuses it first, as bad-target). The suffix after the IPv4
//     address is ignored, as translators ignore it: it never changes a
//     reading, and so cannot hide one.
//   - SIIT IPv4-translated addresses, ::ffff:0:a.b.c.d (::ffff:0:0:0/96,
//     RFC 2765 §2.1): the last 32 bits.
//   - 6to4, 2002:V4ADDR::/48 (2002::/16, RFC 3056 §2): bits 16-47.
//
// So 64:ff9b::a9fe:a9fe, 64:ff9b:1:a9fe:a9:fe00:a01:203 (169.254.169.254 in
// the /48 reading), ::ffff:0:a9fe:a9fe and 2002:a9fe:a9fe::1 are refused as
// 169.254.169.254 is, even when an allowed prefix contains them, and only an
// allowed IPv4 prefix inside the refused range opens them. (The allowed
// prefixes apply to the address as written: allowing 64:ff9b::/96 allows
// what NAT64 reaches, and the readings are judged only against the refused
// ranges.)
type TargetPolicy struct {
	allow []netip.Prefix
	ports []portRange
	// refused holds the default-denied ranges; refusedNames names each for
	// error messages.
	refused      []netip.Prefix
	refusedNames []string
	// nat64 holds the operator's declared NAT64 prefixes (RFC 6052
	// network-specific prefixes), each judged by its length's reading.
	nat64 []netip.Prefix
}

type portRange struct{ lo, hi uint16 }

// NewTargetPolicy builds a policy from CIDR prefixes (or bare addresses) and
// ports or port ranges ("5432", "8000-8999"). Interface addresses are read
// once, now: addresses added to the host later are not refused by default.
//
// nat64Prefixes declares the network-specific prefixes of the NAT64
// translators the forwarder's targets may be reached through (RFC 6052:
// IPv6, of length 32, 40, 48, 56, 64 or 96; a /96 with bits 64-71 zero).
// An address in one is judged by the IPv4 address that prefix length embeds.
// Inside 64:ff9b:1::/48, a declared prefix replaces the four readings the
// address is judged by otherwise, for the addresses it holds; the
// well-known 64:ff9b::/96 needs no declaration and takes none but itself.
func NewTargetPolicy(allowCIDRs, allowPorts []string, nat64Prefixes ...string) (*TargetPolicy, error) {
	p := &TargetPolicy{}
	for _, s := range nat64Prefixes {
		pfx, err := parseNAT64Prefix(s)
		if err != nil {
			return nil, err
		}
		p.nat64 = append(p.nat64, pfx)
	}
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
	readings, err := p.embeddedIPv4(addr)
	if err != nil {
		return fmt.Errorf("%w: %s: %v", ErrTargetDenied, addr, err)
	}
	for _, r := range readings {
		if i, ok := p.refusedRange(r.v4); ok {
			return fmt.Errorf("%w: %s reaches %s as %s, which is %s, refused unless an allowed prefix inside %s names it",
				ErrTargetDenied, addr, r.v4, r.form, p.refusedNames[i], p.refused[i])
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

// The prefixes whose addresses stand for IPv4 addresses.
var (
	nat64WellKnown = netip.MustParsePrefix("64:ff9b::/96")    // RFC 6052 §2.1: IPv4 in the last 32 bits
	nat64LocalUse  = netip.MustParsePrefix("64:ff9b:1::/48")  // RFC 8215: the operator's prefix, /48 to /96, lies inside
	siitTranslated = netip.MustParsePrefix("::ffff:0:0:0/96") // RFC 2765 §2.1: IPv4-translated, ::ffff:0:a.b.c.d
	sixToFour      = netip.MustParsePrefix("2002::/16")       // RFC 3056 §2: 2002:V4ADDR::/48
)

// rfc6052Layout gives, for each RFC 6052 prefix length, the byte offsets
// of the embedded IPv4 address (§2.2, Figure 1). The address never uses
// byte 8, bits 64-71, the "u" octet: for /32 it lies before it, for /40 to
// /64 it straddles or follows it, and for /96 byte 8 lies inside the prefix.
// Bytes after the IPv4 address are the suffix, which readers ignore.
var rfc6052Layout = map[int][4]int{
	32: {4, 5, 6, 7},
	40: {5, 6, 7, 9},
	48: {6, 7, 9, 10},
	56: {7, 9, 10, 11},
	64: {9, 10, 11, 12},
	96: {12, 13, 14, 15},
}

// localUseLengths are the translator prefix lengths RFC 8215 §4 leaves the
// operator inside 64:ff9b:1::/48, in the order they are read.
var localUseLengths = []int{48, 56, 64, 96}

// rfc6052Embedded returns the IPv4 address that an RFC 6052 translator
// whose prefix is bits long (32, 40, 48, 56, 64 or 96) reads from addr, an
// IPv6 address in that prefix: the bytes of rfc6052Layout, whatever the u
// octet (bits 64-71) and the suffix hold. ok is false for another length
// or an address that is not IPv6.
func rfc6052Embedded(addr netip.Addr, bits int) (v4 netip.Addr, ok bool) {
	at, ok := rfc6052Layout[bits]
	if !ok || !addr.Is6() || addr.Is4In6() {
		return netip.Addr{}, false
	}
	b := addr.As16()
	return netip.AddrFrom4([4]byte{b[at[0]], b[at[1]], b[at[2]], b[at[3]]}), true
}

// reading is one IPv4 address an IPv6 target may reach, and how.
type reading struct {
	v4   netip.Addr
	form string
}

// embeddedIPv4 returns every IPv4 address addr may reach through a
// translator or tunnel (see TargetPolicy): nil for an address that embeds
// none. It fails for a NAT64 address whose u octet is not zero.
func (p *TargetPolicy) embeddedIPv4(addr netip.Addr) ([]reading, error) {
	if !addr.Is6() {
		return nil, nil
	}
	b := addr.As16()
	var out []reading
	nat64 := func(pfx netip.Prefix, bits int, what string) error {
		if bits < 96 && b[8] != 0 {
			return fmt.Errorf("bits 64-71 (the RFC 6052 u octet) of an address in the NAT64 prefix %s are %#02x, must be zero", pfx, b[8])
		}
		v4, _ := rfc6052Embedded(addr, bits)
		out = append(out, reading{v4, fmt.Sprintf("NAT64 %s (the /%d reading)", what, bits)})
		return nil
	}
	declared := false
	for _, pfx := range p.nat64 {
		if pfx.Contains(addr) {
			declared = true
			if err := nat64(pfx, pfx.Bits(), "in the declared prefix "+pfx.String()); err != nil {
				return nil, err
			}
		}
	}
	switch {
	case nat64WellKnown.Contains(addr):
		if !declared {
			nat64(nat64WellKnown, 96, "in "+nat64WellKnown.String())
		}
	case nat64LocalUse.Contains(addr):
		if b[8] != 0 {
			// The preamble refuses it first (bad-target, preamble.CheckTarget).
			return nil, fmt.Errorf("bits 64-71 (the RFC 6052 u octet) of an address in the NAT64 prefix %s are %#02x, must be zero", nat64LocalUse, b[8])
		}
		if !declared {
			for _, bits := range localUseLengths {
				nat64(nat64LocalUse, bits, "in "+nat64LocalUse.String())
			}
		}
	case siitTranslated.Contains(addr):
		out = append(out, reading{netip.AddrFrom4([4]byte(b[12:16])), "SIIT (IPv4-translated, " + siitTranslated.String() + ")"})
	case sixToFour.Contains(addr):
		out = append(out, reading{netip.AddrFrom4([4]byte(b[2:6])), "6to4 (" + sixToFour.String() + ")"})
	}
	return out, nil
}

// parseNAT64Prefix checks a declared NAT64 prefix (NewTargetPolicy).
func parseNAT64Prefix(s string) (netip.Prefix, error) {
	pfx, err := netip.ParsePrefix(strings.TrimSpace(s))
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("target policy: NAT64 prefix %q: %v", s, err)
	}
	if !pfx.Addr().Is6() || pfx.Addr().Is4In6() {
		return netip.Prefix{}, fmt.Errorf("target policy: NAT64 prefix %q: want an IPv6 prefix", s)
	}
	if _, ok := rfc6052Layout[pfx.Bits()]; !ok {
		return netip.Prefix{}, fmt.Errorf("target policy: NAT64 prefix %q: RFC 6052 prefixes are /32, /40, /48, /56, /64 or /96", s)
	}
	pfx = pfx.Masked()
	if pfx.Bits() == 96 && pfx.Addr().As16()[8] != 0 {
		return netip.Prefix{}, fmt.Errorf("target policy: NAT64 prefix %q: bits 64-71 of a /96 must be zero (RFC 6052 §2.2)", s)
	}
	if pfx.Overlaps(nat64WellKnown) && pfx != nat64WellKnown {
		return netip.Prefix{}, fmt.Errorf("target policy: NAT64 prefix %q overlaps the well-known prefix %s, which is a /96 (RFC 6052 §2.1)", s, nat64WellKnown)
	}
	return pfx, nil
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
