package ktls

// Offload mode as the kernel reports it: one sock_diag request for the
// socket's exact 4-tuple, answered with the "tls" ULP's view of the socket
// (the same data `ss -tie` prints as tls: version, cipher, rxconf, txconf).

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// Mode says where the records of one direction of a connection are sealed
// or opened.
type Mode uint8

const (
	// ModeUserspace means Go does the record crypto (crypto/tls, or the
	// userspace record opener with the captured keys): the kernel sees
	// ciphertext only.
	ModeUserspace Mode = iota
	// ModeSW means the kernel's TLS layer does the record crypto in software
	// (TLS_SW).
	ModeSW
	// ModeHW means a network device does the record crypto (TLS_HW, or the
	// whole record layer with TLS_HW_RECORD).
	ModeHW
)

// String returns "userspace", "sw" or "hw".
func (m Mode) String() string {
	switch m {
	case ModeUserspace:
		return "userspace"
	case ModeSW:
		return "sw"
	case ModeHW:
		return "hw"
	}
	return fmt.Sprintf("Mode(%d)", uint8(m))
}

// Values from include/uapi/linux/inet_diag.h and include/uapi/linux/tls.h
// that golang.org/x/sys/unix does not export (the same in the Linux 6.1
// UAPI headers and in mainline).
const (
	sizeofInetDiagReqV2 = 56 // struct inet_diag_req_v2
	sizeofInetDiagMsg   = 72 // struct inet_diag_msg
	inetDiagNoCookie    = ^uint32(0)

	// INET_DIAG_ULP_INFO is 19 in the response attribute enum. It cannot be
	// asked for by its own bit (idiag_ext has 8 bits, for attributes up to
	// INET_DIAG_SHUTDOWN): tcp_diag's get_aux adds it only inside the block
	// that answers the INET_DIAG_INFO bit, so a request must set that bit
	// or get no ULP info, even as root (docs/kernel/behaviour.md). Without
	// CAP_NET_ADMIN older kernels (6.1 among them) omit the whole
	// attribute, and newer ones send the ULP name but may withhold the TLS
	// details.
	inetDiagInfo    = 2 // INET_DIAG_INFO (struct tcp_info), requested as 1 << (2-1)
	inetDiagULPInfo = 19
	inetULPInfoName = 1 // INET_ULP_INFO_NAME, NUL-terminated string
	inetULPInfoTLS  = 2 // INET_ULP_INFO_TLS, nested TLS_INFO_*

	tlsInfoVersion  = 1 // TLS_INFO_VERSION, u16 (0x0303, 0x0304); absent before keys are set
	tlsInfoCipher   = 2 // TLS_INFO_CIPHER, u16 TLS_CIPHER_*; absent before keys are set
	tlsInfoTXConf   = 3 // TLS_INFO_TXCONF, u16 TLS_CONF_*
	tlsInfoRXConf   = 4 // TLS_INFO_RXCONF, u16 TLS_CONF_*
	tlsInfoZCRoTX   = 5 // TLS_INFO_ZC_RO_TX, flag (zero-length attribute)
	tlsInfoRXNoPad  = 6 // TLS_INFO_RX_NO_PAD, flag
	tlsConfBase     = 1 // TLS_CONF_BASE: ULP attached, no key for this direction
	tlsConfSW       = 2 // TLS_CONF_SW
	tlsConfHW       = 3 // TLS_CONF_HW
	tlsConfHWRecord = 4 // TLS_CONF_HW_RECORD

	nlaTypeMask = 0x3fff // strips NLA_F_NESTED and NLA_F_NET_BYTEORDER
)

// ulpInfo is the kernel's view of a socket's TLS offload. Cipher is the
// kernel's TLS_CIPHER_* number (51 AES-128-GCM, 52 AES-256-GCM, 54
// ChaCha20-Poly1305), not an IANA suite.
type ulpInfo struct {
	TX, RX     Mode
	Version    uint16
	Cipher     uint16
	ZeroCopyTX bool // TLS_TX_ZEROCOPY_RO in effect (device offload only)
	RXNoPad    bool // TLS_RX_EXPECT_NO_PAD in effect
}

// errDiagNeedsNetAdmin says the answer cannot tell a socket without the
// ULP from one whose details the kernel withheld.
var errDiagNeedsNetAdmin = errors.New("ktls: sock_diag reports TLS offload details only to a process with CAP_NET_ADMIN")

// readULPInfo asks the kernel how the socket's records are processed. A
// socket without the "tls" ULP reports ModeUserspace both ways.
func readULPInfo(rc syscall.RawConn) (ulpInfo, error) {
	buf := diagBuffers.Get().(*[diagBufferSize]byte)
	defer diagBuffers.Put(buf)
	resp, inode, err := querySockDiag(rc, buf[:])
	if err != nil {
		return ulpInfo{}, err
	}
	return decideULPInfo(resp, inode, hasNetAdmin)
}

// diagBufferSize is the room querySockDiag gives an answer: one socket's
// is a few hundred bytes.
const diagBufferSize = 16 << 10

// diagBuffers hold the answers' buffers: every kernel TLS handshake and
// every adoption asks, and a fresh buffer each time was garbage, cleared
// and faulted in, that the collector and the scavenger paid for again.
var diagBuffers = sync.Pool{New: func() any { return new([diagBufferSize]byte) }}

// decideULPInfo interprets a sock_diag answer for the socket with the given
// inode; netAdmin says whether the requester holds CAP_NET_ADMIN, asked
// only for an answer without TLS details.
func decideULPInfo(resp []byte, inode uint64, netAdmin func() bool) (ulpInfo, error) {
	d, err := parseSockDiag(resp, inode)
	if err != nil {
		return ulpInfo{}, err
	}
	switch {
	case d.ulpName == "" && netAdmin():
		return ulpInfo{}, nil // no ULP: crypto/tls does everything
	case d.ulpName == "" || d.ulpName == "tls" && !d.hasTLS && !netAdmin():
		return ulpInfo{}, errDiagNeedsNetAdmin
	case d.ulpName != "tls":
		return ulpInfo{}, fmt.Errorf("ktls: socket carries ULP %q, not tls", d.ulpName)
	case !d.hasTLS:
		return ulpInfo{}, errors.New("ktls: sock_diag answer names the tls ULP but has no TLS details")
	}
	return d.info, nil
}

// querySockDiag sends one exact-socket SOCK_DIAG_BY_FAMILY request for the
// socket's 4-tuple and returns the raw answer, read into buf, and the
// socket's inode, which identifies the answer's socket.
func querySockDiag(rc syscall.RawConn, buf []byte) (resp []byte, inode uint64, err error) {
	var req []byte
	cerr := rc.Control(func(fd uintptr) {
		var st unix.Stat_t
		if err = unix.Fstat(int(fd), &st); err != nil {
			err = fmt.Errorf("ktls: sock_diag: fstat: %w", err)
			return
		}
		inode = st.Ino
		var local, remote unix.Sockaddr
		if local, err = unix.Getsockname(int(fd)); err != nil {
			err = fmt.Errorf("ktls: sock_diag: getsockname: %w", err)
			return
		}
		if remote, err = unix.Getpeername(int(fd)); err != nil {
			err = fmt.Errorf("ktls: sock_diag: getpeername: %w", err)
			return
		}
		req, err = sockDiagRequest(local, remote)
	})
	if cerr != nil {
		return nil, 0, cerr
	}
	if err != nil {
		return nil, 0, err
	}

	nl, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG)
	if err != nil {
		return nil, 0, fmt.Errorf("ktls: sock_diag: netlink socket: %w", err)
	}
	defer unix.Close(nl)
	if err := unix.Sendto(nl, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return nil, 0, fmt.Errorf("ktls: sock_diag: send: %w", err)
	}
	// The kernel answers an exact request synchronously, so this blocking
	// read returns at once.
	n, _, err := unix.Recvfrom(nl, buf, 0)
	if err != nil {
		return nil, 0, fmt.Errorf("ktls: sock_diag: receive: %w", err)
	}
	return buf[:n], inode, nil
}

// sockDiagRequest builds nlmsghdr + inet_diag_req_v2 for the TCP socket
// with this local and remote address (in the kernel's lookup terms: src is
// the socket's own end).
func sockDiagRequest(local, remote unix.Sockaddr) ([]byte, error) {
	var family uint8
	var sport, dport int
	var src, dst [16]byte
	var ifindex uint32
	switch l := local.(type) {
	case *unix.SockaddrInet4:
		r, ok := remote.(*unix.SockaddrInet4)
		if !ok {
			return nil, fmt.Errorf("ktls: sock_diag: peer address %T does not match local IPv4", remote)
		}
		family = unix.AF_INET
		sport, dport = l.Port, r.Port
		copy(src[:], l.Addr[:])
		copy(dst[:], r.Addr[:])
	case *unix.SockaddrInet6:
		r, ok := remote.(*unix.SockaddrInet6)
		if !ok {
			return nil, fmt.Errorf("ktls: sock_diag: peer address %T does not match local IPv6", remote)
		}
		// A v4-mapped address on a dual-stack socket is looked up as such.
		family = unix.AF_INET6
		sport, dport = l.Port, r.Port
		src, dst = l.Addr, r.Addr
		ifindex = l.ZoneId
	default:
		return nil, fmt.Errorf("ktls: sock_diag: %T is not a TCP/IP socket address", local)
	}

	b := make([]byte, unix.SizeofNlMsghdr+sizeofInetDiagReqV2)
	ne := binary.NativeEndian
	ne.PutUint32(b[0:4], uint32(len(b)))           // nlmsg_len
	ne.PutUint16(b[4:6], unix.SOCK_DIAG_BY_FAMILY) // nlmsg_type
	ne.PutUint16(b[6:8], unix.NLM_F_REQUEST)       // no NLM_F_DUMP: exact lookup
	ne.PutUint32(b[8:12], 1)                       // nlmsg_seq
	r := b[unix.SizeofNlMsghdr:]
	r[0] = family                    // sdiag_family
	r[1] = unix.IPPROTO_TCP          // sdiag_protocol
	r[2] = 1 << (inetDiagInfo - 1)   // idiag_ext: INET_DIAG_INFO, which brings the ULP info along
	ne.PutUint32(r[4:8], ^uint32(0)) // idiag_states: all
	id := r[8:]                      // struct inet_diag_sockid
	binary.BigEndian.PutUint16(id[0:2], uint16(sport))
	binary.BigEndian.PutUint16(id[2:4], uint16(dport))
	copy(id[4:20], src[:])
	copy(id[20:36], dst[:])
	ne.PutUint32(id[36:40], ifindex)
	ne.PutUint32(id[40:44], inetDiagNoCookie)
	ne.PutUint32(id[44:48], inetDiagNoCookie)
	return b, nil
}

// sockDiagAnswer is what parseSockDiag found for the wanted socket.
type sockDiagAnswer struct {
	ulpName string // "" when the answer has no INET_DIAG_ULP_INFO
	hasTLS  bool   // INET_ULP_INFO_TLS present (only for CAP_NET_ADMIN)
	info    ulpInfo
}

// parseSockDiag walks a netlink answer and decodes the attributes of the
// inet_diag_msg whose socket has the given inode.
func parseSockDiag(b []byte, inode uint64) (sockDiagAnswer, error) {
	ne := binary.NativeEndian
	for len(b) > 0 {
		if len(b) < unix.SizeofNlMsghdr {
			return sockDiagAnswer{}, fmt.Errorf("ktls: sock_diag: truncated netlink header (%d bytes)", len(b))
		}
		msgLen := int(ne.Uint32(b[0:4]))
		typ := ne.Uint16(b[4:6])
		if msgLen < unix.SizeofNlMsghdr || msgLen > len(b) {
			return sockDiagAnswer{}, fmt.Errorf("ktls: sock_diag: netlink message length %d out of range (%d bytes left)", msgLen, len(b))
		}
		payload := b[unix.SizeofNlMsghdr:msgLen]
		switch typ {
		case unix.NLMSG_ERROR:
			if len(payload) < 4 {
				return sockDiagAnswer{}, errors.New("ktls: sock_diag: truncated netlink error")
			}
			switch errno := syscall.Errno(-int32(ne.Uint32(payload[0:4]))); errno {
			case 0:
			case syscall.ENOENT:
				// Either no socket has that 4-tuple (closed meanwhile), or
				// the kernel has no TCP diag handler: inet_diag and
				// tcp_diag are modules, loaded on demand through modprobe.
				return sockDiagAnswer{}, fmt.Errorf("ktls: sock_diag: no such socket, or the inet_diag/tcp_diag modules are not loaded: %w", errno)
			default:
				return sockDiagAnswer{}, fmt.Errorf("ktls: sock_diag: %w", errno)
			}
		case unix.SOCK_DIAG_BY_FAMILY:
			if len(payload) < sizeofInetDiagMsg {
				return sockDiagAnswer{}, fmt.Errorf("ktls: sock_diag: inet_diag_msg of %d bytes, want %d", len(payload), sizeofInetDiagMsg)
			}
			if got := uint64(ne.Uint32(payload[68:72])); got == inode { // idiag_inode
				return parseDiagAttrs(payload[sizeofInetDiagMsg:])
			}
		}
		b = b[nlAlign(msgLen):]
	}
	return sockDiagAnswer{}, fmt.Errorf("ktls: sock_diag: no answer for socket inode %d", inode)
}

// parseDiagAttrs decodes the inet_diag_msg attributes, of which only
// INET_DIAG_ULP_INFO matters here.
func parseDiagAttrs(b []byte) (sockDiagAnswer, error) {
	var a sockDiagAnswer
	err := walkAttrs(b, func(typ uint16, v []byte) error {
		if typ != inetDiagULPInfo {
			return nil
		}
		return walkAttrs(v, func(typ uint16, v []byte) error {
			switch typ {
			case inetULPInfoName:
				a.ulpName = cString(v)
			case inetULPInfoTLS:
				a.hasTLS = true
				return walkAttrs(v, a.info.setTLSAttr)
			}
			return nil
		})
	})
	return a, err
}

// setTLSAttr decodes one TLS_INFO_* attribute.
func (u *ulpInfo) setTLSAttr(typ uint16, v []byte) error {
	u16 := func() (uint16, error) {
		if len(v) < 2 {
			return 0, fmt.Errorf("ktls: sock_diag: TLS_INFO attribute %d has %d bytes, want 2", typ, len(v))
		}
		return binary.NativeEndian.Uint16(v), nil
	}
	var err error
	switch typ {
	case tlsInfoVersion:
		u.Version, err = u16()
	case tlsInfoCipher:
		u.Cipher, err = u16()
	case tlsInfoTXConf, tlsInfoRXConf:
		var conf uint16
		if conf, err = u16(); err != nil {
			return err
		}
		m, merr := confMode(conf)
		if merr != nil {
			return merr
		}
		if typ == tlsInfoTXConf {
			u.TX = m
		} else {
			u.RX = m
		}
	case tlsInfoZCRoTX:
		u.ZeroCopyTX = true
	case tlsInfoRXNoPad:
		u.RXNoPad = true
	}
	return err
}

// confMode maps TLS_CONF_* to a Mode.
func confMode(conf uint16) (Mode, error) {
	switch conf {
	case tlsConfBase:
		return ModeUserspace, nil
	case tlsConfSW:
		return ModeSW, nil
	case tlsConfHW, tlsConfHWRecord:
		return ModeHW, nil
	}
	return 0, fmt.Errorf("ktls: sock_diag: unknown TLS_CONF value %d", conf)
}

// walkAttrs calls f for each netlink attribute in b (struct nlattr: u16
// length including the 4-byte header, u16 type; values padded to 4 bytes).
func walkAttrs(b []byte, f func(typ uint16, v []byte) error) error {
	ne := binary.NativeEndian
	for len(b) >= unix.SizeofNlAttr {
		n := int(ne.Uint16(b[0:2]))
		typ := ne.Uint16(b[2:4]) & nlaTypeMask
		if n < unix.SizeofNlAttr || n > len(b) {
			return fmt.Errorf("ktls: sock_diag: attribute %d length %d out of range (%d bytes left)", typ, n, len(b))
		}
		if err := f(typ, b[unix.SizeofNlAttr:n]); err != nil {
			return err
		}
		b = b[min(nlAlign(n), len(b)):]
	}
	return nil
}

func nlAlign(n int) int { return (n + 3) &^ 3 }

// cString returns b up to its first NUL.
func cString(b []byte) string {
	for i, c := range b {
		if c == 0 {
			return string(b[:i])
		}
	}
	return string(b)
}
