package ktls

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"golang.org/x/sys/unix"
)

func TestModeString(t *testing.T) {
	for m, want := range map[Mode]string{ModeUserspace: "userspace", ModeSW: "sw", ModeHW: "hw", Mode(9): "Mode(9)"} {
		if got := m.String(); got != want {
			t.Errorf("Mode(%d).String() = %q, want %q", uint8(m), got, want)
		}
	}
}

// diagFixture is a recorded sock_diag answer from testdata: hex bytes with
// "# key: value" header lines (inode of the socket asked about).
type diagFixture struct {
	resp  []byte
	inode uint64
}

func loadDiagFixture(t *testing.T, name string) diagFixture {
	t.Helper()
	f, err := os.Open(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var fx diagFixture
	var hexText strings.Builder
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if v, ok := strings.CutPrefix(line, "# inode:"); ok {
			if fx.inode, err = strconv.ParseUint(strings.TrimSpace(v), 10, 64); err != nil {
				t.Fatal(err)
			}
		}
		if !strings.HasPrefix(line, "#") {
			hexText.WriteString(strings.Join(strings.Fields(line), ""))
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if fx.resp, err = hex.DecodeString(hexText.String()); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	if fx.inode == 0 {
		t.Fatalf("%s: no '# inode:' line", name)
	}
	return fx
}

// The fixtures are answers recorded from Linux 6.1 and 7.3 in the VM
// (TestKernelULPInfo with KTLS_DIAG_RECORD_DIR) and one derived from them
// for device offload; testdata/README.md says how each was made.
func TestDecodeULPInfoFixtures(t *testing.T) {
	for _, c := range []struct {
		file string
		want ulpInfo
	}{
		{"diag_6.1_no_ulp.hex", ulpInfo{}},
		{"diag_6.1_ulp_no_keys.hex", ulpInfo{}},
		{"diag_6.1_sw_sw.hex", ulpInfo{TX: ModeSW, RX: ModeSW, Version: tls.VersionTLS13, Cipher: kernelAESGCM128}},
		{"diag_7.3_no_ulp.hex", ulpInfo{}},
		{"diag_7.3_sw_sw_nopad.hex", ulpInfo{TX: ModeSW, RX: ModeSW, Version: tls.VersionTLS13, Cipher: kernelAESGCM128, RXNoPad: true}},
		{"diag_hw_sw_zerocopy.hex", ulpInfo{TX: ModeHW, RX: ModeSW, Version: tls.VersionTLS13, Cipher: kernelAESGCM256, ZeroCopyTX: true}},
	} {
		fx := loadDiagFixture(t, c.file)
		got, err := decideULPInfo(fx.resp, fx.inode, yes)
		if err != nil {
			t.Errorf("%s: %v", c.file, err)
			continue
		}
		if got != c.want {
			t.Errorf("%s: %+v, want %+v", c.file, got, c.want)
		}
	}
}

// yes and no are a requester's CAP_NET_ADMIN for decideULPInfo.
func yes() bool { return true }
func no() bool  { return false }

// Whether the requester holds CAP_NET_ADMIN (a capget(2) per answer) is
// asked only of an answer without TLS details, which it decides.
func TestDecodeULPInfoAsksNetAdminOnlyWhenItDecides(t *testing.T) {
	for _, c := range []struct {
		file string
		asks int
	}{
		{"diag_6.1_sw_sw.hex", 0},
		{"diag_7.3_sw_sw_nopad.hex", 0},
		{"diag_6.1_no_ulp.hex", 1},
		{"diag_6.1_ulp_no_keys.hex", 0}, // TLS details, no keys yet
	} {
		fx := loadDiagFixture(t, c.file)
		asked := 0
		if _, err := decideULPInfo(fx.resp, fx.inode, func() bool { asked++; return true }); err != nil {
			t.Errorf("%s: %v", c.file, err)
		}
		if asked != c.asks {
			t.Errorf("%s: CAP_NET_ADMIN asked %d times, want %d", c.file, asked, c.asks)
		}
	}
}

func TestDecodeULPInfoWithoutNetAdmin(t *testing.T) {
	// 6.1 leaves INET_DIAG_ULP_INFO out for a requester without
	// CAP_NET_ADMIN, so "no attribute" proves nothing then.
	fx := loadDiagFixture(t, "diag_6.1_no_ulp.hex")
	if _, err := decideULPInfo(fx.resp, fx.inode, no); !errors.Is(err, errDiagNeedsNetAdmin) {
		t.Fatalf("no ULP attribute without CAP_NET_ADMIN: %v, want errDiagNeedsNetAdmin", err)
	}
	// Details present are believed whoever asked.
	fx = loadDiagFixture(t, "diag_6.1_sw_sw.hex")
	if got, err := decideULPInfo(fx.resp, fx.inode, no); err != nil || got.TX != ModeSW {
		t.Fatalf("TLS details without CAP_NET_ADMIN: %+v, %v", got, err)
	}
}

func TestDecodeULPInfoRejects(t *testing.T) {
	fx := loadDiagFixture(t, "diag_6.1_sw_sw.hex")
	if _, err := decideULPInfo(fx.resp, fx.inode+1, yes); err == nil || !strings.Contains(err.Error(), "no answer for socket inode") {
		t.Errorf("other inode: %v", err)
	}
	if _, err := decideULPInfo(fx.resp[:len(fx.resp)-3], fx.inode, yes); err == nil {
		t.Error("truncated answer accepted")
	}
	if _, err := decideULPInfo(fx.resp[:20], fx.inode, yes); err == nil {
		t.Error("answer cut inside inet_diag_msg accepted")
	}
	// Break the first attribute's length: it claims more than is left.
	bad := bytes.Clone(fx.resp)
	binary.NativeEndian.PutUint16(bad[unix.SizeofNlMsghdr+sizeofInetDiagMsg:], 0xfff0)
	if _, err := decideULPInfo(bad, fx.inode, yes); err == nil || !strings.Contains(err.Error(), "out of range") {
		t.Errorf("oversized attribute: %v", err)
	}

	// An NLMSG_ERROR answer carries the errno (ENOENT: no such socket).
	nlerr := make([]byte, unix.SizeofNlMsghdr+4)
	binary.NativeEndian.PutUint32(nlerr[0:4], uint32(len(nlerr)))
	binary.NativeEndian.PutUint16(nlerr[4:6], unix.NLMSG_ERROR)
	enoent := -int32(unix.ENOENT)
	binary.NativeEndian.PutUint32(nlerr[16:20], uint32(enoent))
	if _, err := decideULPInfo(nlerr, 1, yes); !errors.Is(err, syscall.ENOENT) {
		t.Errorf("NLMSG_ERROR: %v, want ENOENT", err)
	}
}

func TestSockDiagRequestLayout(t *testing.T) {
	local := &unix.SockaddrInet6{Port: 443, Addr: [16]byte{0: 0xfe, 1: 0x80, 15: 1}, ZoneId: 3}
	remote := &unix.SockaddrInet6{Port: 50000, Addr: [16]byte{0: 0xfe, 1: 0x80, 15: 2}}
	b, err := sockDiagRequest(local, remote)
	if err != nil {
		t.Fatal(err)
	}
	ne := binary.NativeEndian
	if len(b) != 72 || ne.Uint32(b[0:4]) != 72 || ne.Uint16(b[4:6]) != unix.SOCK_DIAG_BY_FAMILY || ne.Uint16(b[6:8]) != unix.NLM_F_REQUEST {
		t.Fatalf("netlink header %x", b[:16])
	}
	r := b[16:]
	if r[0] != unix.AF_INET6 || r[1] != unix.IPPROTO_TCP || r[2] != 1<<(inetDiagInfo-1) || ne.Uint32(r[4:8]) != ^uint32(0) {
		t.Fatalf("inet_diag_req_v2 head %x", r[:8])
	}
	id := r[8:]
	if binary.BigEndian.Uint16(id[0:2]) != 443 || binary.BigEndian.Uint16(id[2:4]) != 50000 ||
		!bytes.Equal(id[4:20], local.Addr[:]) || !bytes.Equal(id[20:36], remote.Addr[:]) ||
		ne.Uint32(id[36:40]) != 3 || ne.Uint32(id[40:44]) != inetDiagNoCookie || ne.Uint32(id[44:48]) != inetDiagNoCookie {
		t.Fatalf("inet_diag_sockid %x", id)
	}
	if _, err := sockDiagRequest(&unix.SockaddrInet4{}, remote); err == nil {
		t.Error("mixed address families accepted")
	}
	if _, err := sockDiagRequest(&unix.SockaddrUnix{Name: "x"}, &unix.SockaddrUnix{}); err == nil {
		t.Error("unix socket accepted")
	}
}

// TestReadULPInfoPlainTCP asks the host kernel about plain TCP sockets
// (this needs sock_diag, not kTLS) over IPv4, IPv6 and a dual-stack
// listener, whose accepted socket is AF_INET6 with v4-mapped addresses:
// both ends must read as userspace, or, without CAP_NET_ADMIN, say that
// the answer cannot tell.
func TestReadULPInfoPlainTCP(t *testing.T) {
	for _, c := range []struct{ network, listen, dialHost string }{
		{"tcp4", "127.0.0.1:0", "127.0.0.1"},
		{"tcp6", "[::1]:0", "::1"},
		{"tcp", ":0", "127.0.0.1"}, // dual stack
	} {
		network := c.network
		ln, err := net.Listen(network, c.listen)
		if err != nil {
			t.Logf("%s: no loopback (%v)", network, err)
			continue
		}
		fdsBefore := kerneltest.OpenFDs(t)
		client, err := net.Dial("tcp", net.JoinHostPort(c.dialHost, strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)))
		if err != nil {
			t.Fatal(err)
		}
		server, err := ln.Accept()
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range []net.Conn{client, server} {
			info, err := readULPInfo(syscallConn(t, c))
			switch {
			case err == nil && info == (ulpInfo{}):
			case errors.Is(err, errDiagNeedsNetAdmin) && !hasNetAdmin():
			default:
				t.Errorf("%s %v: %+v, %v; want userspace", network, c.LocalAddr(), info, err)
			}
		}
		client.Close()
		server.Close()
		if after := kerneltest.OpenFDs(t); after != fdsBefore {
			t.Errorf("%s: open fds %d before, %d after", network, fdsBefore, after)
		}
		ln.Close()
	}
}

// TestKernelULPInfo reads a real socket's offload state through sock_diag
// at each step: plain TCP, "tls" ULP without keys, TLS 1.3 AES-128-GCM keys
// for TX and RX (dummy keys: the kernel does not check them), then
// TLS_RX_EXPECT_NO_PAD where the kernel has it. The peer socket of the same
// connection must keep reading as userspace throughout, which shows the
// answer is matched to the exact socket. With KTLS_DIAG_RECORD_DIR set, the
// raw answers are written there (how the testdata fixtures were made).
func TestKernelULPInfo(t *testing.T) {
	kerneltest.Require(t)
	// The runtime's netpoller opens its epoll and wakeup descriptors with
	// the first network socket: let that happen before counting.
	if ln, err := net.Listen("tcp", "127.0.0.1:0"); err == nil {
		ln.Close()
	}
	fdsBefore := kerneltest.OpenFDs(t)
	client, server := loopbackPair(t)
	rc := syscallConn(t, server)
	peer := syscallConn(t, client)

	step := func(name string, want ulpInfo) {
		t.Helper()
		resp, inode, err := querySockDiag(rc, make([]byte, diagBufferSize))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if dir := os.Getenv("KTLS_DIAG_RECORD_DIR"); dir != "" {
			var uts unix.Utsname
			_ = unix.Uname(&uts)
			head := "# kernel: " + unix.ByteSliceToString(uts.Release[:]) + "\n# inode: " + strconv.FormatUint(inode, 10) + "\n"
			if err := os.WriteFile(filepath.Join(dir, "diag_"+name+".hex"), []byte(head+hexLines(resp)), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		got, err := decideULPInfo(resp, inode, hasNetAdmin)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if got != want {
			t.Fatalf("%s: %+v, want %+v", name, got, want)
		}
		if viaRawConn, err := readULPInfo(rc); err != nil || viaRawConn != want {
			t.Fatalf("%s: readULPInfo = %+v, %v; want %+v", name, viaRawConn, err, want)
		}
		if p, err := readULPInfo(peer); err != nil || p != (ulpInfo{}) {
			t.Fatalf("%s: peer socket reads %+v, %v; want userspace", name, p, err)
		}
		t.Logf("%s: %d-byte answer: TX %v RX %v version %#04x cipher %d zerocopy %v nopad %v",
			name, len(resp), got.TX, got.RX, got.Version, got.Cipher, got.ZeroCopyTX, got.RXNoPad)
	}

	step("no_ulp", ulpInfo{})
	err := controlFD(rc, func(fd int) error { return unix.SetsockoptString(fd, unix.IPPROTO_TCP, unix.TCP_ULP, "tls") })
	if err != nil {
		t.Fatalf("TCP_ULP: %v", err)
	}
	step("ulp_no_keys", ulpInfo{})
	key, iv := make([]byte, 16), make([]byte, 12)
	info, err := cryptoInfo(tls.VersionTLS13, tls.TLS_AES_128_GCM_SHA256, key, iv, 0)
	if err != nil {
		t.Fatal(err)
	}
	stat := kerneltest.StatDelta(t, func() {
		err = controlFD(rc, func(fd int) error {
			if err := setsockoptBytes(fd, unix.SOL_TLS, optTLSTX, info); err != nil {
				return err
			}
			return setsockoptBytes(fd, unix.SOL_TLS, optTLSRX, info)
		})
	})
	if err != nil {
		t.Fatalf("TLS_TX/TLS_RX: %v", err)
	}
	if stat["TlsCurrTxSw"] != 1 || stat["TlsCurrRxSw"] != 1 {
		t.Fatalf("tls_stat moved %v, want TlsCurrTxSw and TlsCurrRxSw +1", stat)
	}
	want := ulpInfo{TX: ModeSW, RX: ModeSW, Version: tls.VersionTLS13, Cipher: kernelAESGCM128}
	step("sw_sw", want)
	// TLS_RX_EXPECT_NO_PAD arrived in 6.0, as did the kernels of the matrix.
	if err := controlFD(rc, func(fd int) error { return unix.SetsockoptInt(fd, unix.SOL_TLS, optRXExpectNoPad, 1) }); err != nil {
		t.Fatalf("TLS_RX_EXPECT_NO_PAD: %v", err)
	}
	want.RXNoPad = true
	step("sw_sw_nopad", want)

	client.Close()
	server.Close()
	if after := kerneltest.OpenFDs(t); after != fdsBefore {
		t.Fatalf("open fds %d before, %d after", fdsBefore, after)
	}
}

// hexLines renders b as lines of 16 space-separated hex bytes.
func hexLines(b []byte) string {
	var sb strings.Builder
	for len(b) > 0 {
		n := min(16, len(b))
		for i, c := range b[:n] {
			if i > 0 {
				sb.WriteByte(' ')
			}
			sb.WriteString(hex.EncodeToString([]byte{c}))
		}
		sb.WriteByte('\n')
		b = b[n:]
	}
	return sb.String()
}

func syscallConn(t testing.TB, c net.Conn) syscall.RawConn {
	t.Helper()
	rc, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	return rc
}

// BenchmarkReadULPInfo is what every kernel TLS handshake and every
// adoption pays to learn how the kernel processes the socket's records
// (here a plain TCP socket, which any host has: its answer has no ULP).
func BenchmarkReadULPInfo(b *testing.B) {
	_, server := loopbackPair(b)
	rc := syscallConn(b, server)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := readULPInfo(rc); err != nil && !errors.Is(err, errDiagNeedsNetAdmin) {
			b.Fatal(err)
		}
	}
}
