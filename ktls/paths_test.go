package ktls

import (
	"crypto/tls"
	"errors"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
)

// layeredConn is a Layered conn as caddy-l4 presents one: reads and writes
// go through the layer (here straight to the socket), and Socket answers
// with socketErr when the layer claims to hold unread bytes.
type layeredConn struct {
	net.Conn
	sock      *net.TCPConn
	socketErr error
}

func (l *layeredConn) Socket() (*net.TCPConn, error) {
	if l.socketErr != nil {
		return nil, l.socketErr
	}
	return l.sock, nil
}

// layer wraps an accepted TCP conn; socketErr nil means the layer is empty.
func layer(socketErr error) func(net.Conn) net.Conn {
	return func(c net.Conn) net.Conn {
		return &layeredConn{Conn: c, sock: c.(*net.TCPConn), socketErr: socketErr}
	}
}

var errLayerBuffered = errors.New("layer still holds 7 unread bytes")

// TestLayeredSocket: kernelSocket takes the socket from an empty
// layer and refuses a layer that still buffers bytes (the kernel would
// never see them) with ReasonBufferedBytes and the layer's own error.
func TestLayeredSocket(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	tcp := c.(*net.TCPConn)
	if sock, reason, err := kernelSocket(layer(nil)(tcp)); err != nil || sock != tcp || reason != ReasonNone {
		t.Fatalf("empty layer: %v, %q, %v; want the TCP conn", sock, reason, err)
	}
	sock, reason, err := kernelSocket(layer(errLayerBuffered)(tcp))
	if sock != nil || reason != ReasonBufferedBytes || !errors.Is(err, errLayerBuffered) {
		t.Fatalf("buffering layer: %v, %q, %v; want %q with the layer's error", sock, reason, err, ReasonBufferedBytes)
	}
	if _, reason, err := kernelSocket(struct{ net.Conn }{tcp}); reason != ReasonNotTCP || err == nil {
		t.Fatalf("hidden TCP conn: %q, %v; want %q", reason, err, ReasonNotTCP)
	}
}

// TestKernelLayered: a connection under a Layered conn is offloaded through
// the socket Socket returns, and falls back to crypto/tls, intact, when the
// layer still holds bytes.
func TestKernelLayered(t *testing.T) {
	kerneltest.Require(t)
	checkNoFDLeak(t, kerneltest.OpenFDs)
	p := newTestPKI(t)
	n := bulkSize(t, defaultBulkMiB)
	scfg, ccfg := p.configs(connCases[0])
	for _, tc := range []struct {
		name      string
		socketErr error
		want      Reason
		installs  int64
		mode      Mode
	}{
		{"empty-layer", nil, ReasonNone, 1, ModeSW},
		{"buffering-layer", errLayerBuffered, ReasonBufferedBytes, 0, ModeUserspace},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := statDelta(t, func() {
				pr, err := dialPair(t, scfg, ccfg, Options{}, layer(tc.socketErr))
				if err != nil {
					t.Fatal(err)
				}
				if off := pr.server.Offload(); off.Reason != tc.want || off.TX != tc.mode || off.RX != tc.mode {
					t.Fatalf("Offload() = %+v, want reason %q, %v both ways", off, tc.want, tc.mode)
				}
				exchange(t, pr, n)
				pr.close()
			})
			wantStat(t, d, "TlsTxSw", tc.installs)
			wantStat(t, d, "TlsRxSw", tc.installs)
		})
	}
}

// TestKernelTXZeroCopyRO: the kernel takes TLS_TX_ZEROCOPY_RO and reads it
// back, a file sent through ReadFrom (sendfile) arrives intact, and sock_diag
// reports zerocopy exactly where the kernel applies it: device offload only.
func TestKernelTXZeroCopyRO(t *testing.T) {
	kerneltest.Require(t)
	if !Probe().TXZeroCopyRO {
		t.Fatalf("kernel refuses TLS_TX_ZEROCOPY_RO:\n%v", Probe())
	}
	p := newTestPKI(t)
	n := bulkSize(t, defaultBulkMiB)
	scfg, ccfg := p.configs(connCases[0])
	var pr *pair
	d := statDelta(t, func() {
		var err error
		if pr, err = dialPair(t, scfg, ccfg, Options{TXZeroCopyRO: true}, nil); err != nil {
			t.Fatal(err)
		}
		if off := pr.server.Offload(); off.Reason != ReasonNone {
			t.Fatalf("Offload() = %+v, want reason none", off)
		}
		var set int
		if err := controlFD(pr.server.rawSock, func(fd int) (err error) {
			set, err = unix.GetsockoptInt(fd, unix.SOL_TLS, optTXZeroCopyRO)
			return err
		}); err != nil || set != 1 {
			t.Fatalf("getsockopt(TLS_TX_ZEROCOPY_RO) = %d, %v; want 1", set, err)
		}
		info, err := readULPInfo(pr.server.rawSock)
		if err != nil {
			t.Fatal(err)
		}
		if info.ZeroCopyTX != (info.TX == ModeHW) {
			t.Fatalf("sock_diag zerocopy %v with TX %v: the kernel reports it for device offload only", info.ZeroCopyTX, info.TX)
		}
		readFromFile(t, pr, 11, n)
		exchange(t, pr, 64<<10)
	})
	wantStat(t, d, "TlsTxSw", 1)
	wantStat(t, d, "TlsDecryptError", 0)
}

// closedAfterTXChild names the environment variable that makes
// TestKernelClosedAfterTX run its scenario instead of re-executing itself.
const closedAfterTXChild = "KTLS_TEST_CLOSED_AFTER_TX_CHILD"

// TestKernelClosedAfterTX: TLS_RX fails after TLS_TX went in, so crypto/tls
// cannot write any more: the connection is closed, reported and counted.
// No kernel refuses TLS_RX for a suite it took for TLS_TX and passed in
// Probe, so a seccomp filter makes setsockopt(SOL_TLS, TLS_RX) fail with
// EPERM. The filter cannot be lifted and covers every thread, so the
// scenario runs in a child process: this test binary, re-executed.
func TestKernelClosedAfterTX(t *testing.T) {
	kerneltest.Require(t)
	if os.Getenv(closedAfterTXChild) == "" {
		exe, err := os.Executable()
		if err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command(exe, "-test.run", "^TestKernelClosedAfterTX$", "-test.v")
		cmd.Env = append(os.Environ(), closedAfterTXChild+"=1")
		out, err := cmd.CombinedOutput()
		if err != nil || !strings.Contains(string(out), "--- PASS: TestKernelClosedAfterTX") {
			t.Fatalf("child: %v\n%s", err, out)
		}
		t.Logf("child:\n%s", out)
		return
	}
	// The listener comes first: in this fresh process it also starts the
	// netpoller, whose epoll and wakeup fds stay open for good.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	checkNoFDLeak(t, kerneltest.OpenFDs)
	p := newTestPKI(t)
	scfg, ccfg := p.configs(connCases[0])
	Probe() // before the filter, which would make it report RX unsupported
	denyTLSRX(t)

	var mu sync.Mutex
	var events []Event
	opts := Options{Observer: func(e Event) {
		mu.Lock()
		events = append(events, e)
		mu.Unlock()
	}}
	before := Stats()
	clientRead := make(chan error, 1)
	go func() {
		c, err := tls.Dial("tcp", ln.Addr().String(), ccfg)
		if err != nil {
			clientRead <- err
			return
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(time.Minute))
		_, err = c.Read(make([]byte, 1))
		clientRead <- err
	}()
	raw, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	server := Server(raw, scfg, opts)
	var hsErr error
	d := statDelta(t, func() { hsErr = server.Handshake() })

	var oe *OffloadError
	if !errors.As(hsErr, &oe) || oe.Reason != ReasonSetsockoptRX || !errors.Is(hsErr, unix.EPERM) {
		t.Fatalf("handshake: %v, want an OffloadError %q wrapping the filter's EPERM", hsErr, ReasonSetsockoptRX)
	}
	wantStat(t, d, "TlsTxSw", 1)
	wantStat(t, d, "TlsRxSw", 0)
	if _, err := raw.Write([]byte("x")); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("raw conn write after the failure: %v, want it closed", err)
	}
	if err := <-clientRead; err == nil || isTimeout(err) {
		t.Fatalf("client read: %v, want the connection closed", err)
	}
	if _, err := server.Write([]byte("x")); err == nil {
		t.Fatal("Write succeeded on a connection closed after TX")
	}
	after := Stats()
	if got := after.ClosedAfterTX - before.ClosedAfterTX; got != 1 {
		t.Errorf("Stats().ClosedAfterTX grew by %d, want 1", got)
	}
	if got := after.Outcomes[ReasonSetsockoptRX] - before.Outcomes[ReasonSetsockoptRX]; got != 1 {
		t.Errorf("Stats().Outcomes[setsockopt-rx] grew by %d, want 1", got)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(events) != 2 || events[0].Kind != EventHandshake || events[1].Kind != EventClosed ||
		events[0].Offload.Reason != ReasonSetsockoptRX || events[0].Offload.TX != ModeSW || !errors.Is(events[1].Err, unix.EPERM) {
		t.Fatalf("observer events %+v, want handshake (setsockopt-rx, TX sw) then closed-after-tx", events)
	}
}

// denyTLSRX installs, on every thread of this process, a seccomp filter
// under which setsockopt(fd, SOL_TLS, TLS_RX, …) fails with EPERM and every
// other system call runs as usual. Irreversible: child processes only.
func denyTLSRX(t *testing.T) {
	arch := map[string]uint32{"amd64": unix.AUDIT_ARCH_X86_64, "arm64": unix.AUDIT_ARCH_AARCH64}[runtime.GOARCH]
	if arch == 0 {
		t.Fatalf("no seccomp audit arch known for %s", runtime.GOARCH)
	}
	// struct seccomp_data: nr at 0, arch at 4, args[i] at 16+8i (the low
	// 32 bits first on these little-endian machines). Jumps count the
	// instructions skipped; all misses go to the final allow.
	const load = unix.BPF_LD | unix.BPF_W | unix.BPF_ABS
	const jeq = unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K
	prog := []unix.SockFilter{
		{Code: load, K: 4},
		{Code: jeq, K: arch, Jf: 7},
		{Code: load, K: 0},
		{Code: jeq, K: unix.SYS_SETSOCKOPT, Jf: 5},
		{Code: load, K: 16 + 8*1},
		{Code: jeq, K: unix.SOL_TLS, Jf: 3},
		{Code: load, K: 16 + 8*2},
		{Code: jeq, K: optTLSRX, Jf: 1},
		{Code: unix.BPF_RET | unix.BPF_K, K: unix.SECCOMP_RET_ERRNO | uint32(unix.EPERM)},
		{Code: unix.BPF_RET | unix.BPF_K, K: unix.SECCOMP_RET_ALLOW},
	}
	fprog := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		t.Fatalf("prctl(PR_SET_NO_NEW_PRIVS): %v", err)
	}
	// TSYNC: the goroutine that installs the keys may run on any thread.
	if r, _, errno := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, unix.SECCOMP_FILTER_FLAG_TSYNC, uintptr(unsafe.Pointer(&fprog))); errno != 0 || r != 0 {
		t.Fatalf("seccomp(SET_MODE_FILTER, TSYNC): %d, %v", r, errno)
	}
	runtime.KeepAlive(prog)
}
