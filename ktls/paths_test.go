package ktls

import (
	"crypto/tls"
	"errors"
	"net"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"strings"
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
// never see them) with ReasonBufferedBytes and the layer's own error, and
// a layer over no TCP socket with ReasonNotTCP.
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
	if sock, reason, err := kernelSocket(&layeredConn{Conn: tcp}); sock != nil || reason != ReasonNotTCP || err == nil {
		t.Fatalf("layer over no TCP socket: %v, %q, %v; want %q", sock, reason, err, ReasonNotTCP)
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

// childEnv names the environment variable that makes the test binary,
// re-executed by inChild, run the scenario of the test it names.
const childEnv = "KTLS_TEST_CHILD"

// inChild reports whether this process is the child that runs t's
// scenario. In the parent it re-executes this test binary for t alone,
// requires it to pass, logs its output and returns false. Tests that
// install a seccomp filter run their scenario in the child: the filter
// cannot be lifted and covers every thread of the process.
func inChild(t *testing.T) bool {
	t.Helper()
	if os.Getenv(childEnv) == t.Name() {
		// The netpoller's epoll and wakeup fds open at this fresh
		// process's first network use and stay: open them before any leak
		// check counts.
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ln.Close()
		return true
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	parts := strings.Split(t.Name(), "/")
	for i, part := range parts {
		parts[i] = "^" + regexp.QuoteMeta(part) + "$"
	}
	cmd := exec.Command(exe, "-test.run", strings.Join(parts, "/"), "-test.v")
	cmd.Env = append(os.Environ(), childEnv+"="+t.Name())
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: "+t.Name()+" ") {
		t.Fatalf("child: %v\n%s", err, out)
	}
	t.Logf("child:\n%s", out)
	return false
}

// TestKernelClosedAfterTX: TLS_RX fails after TLS_TX went in, so crypto/tls
// cannot write any more: the connection is closed, reported and counted.
// No kernel refuses TLS_RX for a suite it took for TLS_TX and passed in
// Probe, so a seccomp filter makes setsockopt(SOL_TLS, TLS_RX) fail with
// EPERM, in a child process (inChild).
func TestKernelClosedAfterTX(t *testing.T) {
	kerneltest.Require(t)
	if !inChild(t) {
		return
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	checkNoFDLeak(t, kerneltest.OpenFDs)
	p := newTestPKI(t)
	scfg, ccfg := p.configs(connCases[0])
	Probe() // before the filter, which would make it report RX unsupported
	denySetsockopt(t, unix.SOL_TLS, optTLSRX)
	var rec eventRecorder
	opts := Options{Observer: rec.observe}
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
	if events := rec.seen(); len(events) != 2 || events[0].Kind != EventHandshake || events[1].Kind != EventClosed ||
		events[0].Offload.Reason != ReasonSetsockoptRX || events[0].Offload.TX != ModeSW || !errors.Is(events[1].Err, unix.EPERM) {
		t.Fatalf("observer events %+v, want handshake (setsockopt-rx, TX sw) then closed-after-tx", events)
	}
}

// TestKernelSetsockoptFallback: TCP_ULP or TLS_TX fails before anything is
// installed (a seccomp filter makes the call return EPERM, in a child
// process: no kernel that passed Probe refuses them on an established
// socket), so the connection carries on as userspace TLS with that reason:
// it moves the bulk data intact both ways, and the observer and counters
// see the reason and the errno. After a TLS_TX failure the socket keeps
// the "tls" ULP without keys, which passes plain bytes.
func TestKernelSetsockoptFallback(t *testing.T) {
	kerneltest.Require(t)
	for _, tc := range []struct {
		reason     Reason
		level, opt uint32
		ulp        string // getsockopt(TCP_ULP) afterwards
	}{
		{ReasonSetsockoptULP, unix.IPPROTO_TCP, unix.TCP_ULP, ""},
		{ReasonSetsockoptTX, unix.SOL_TLS, optTLSTX, "tls"},
	} {
		t.Run(string(tc.reason), func(t *testing.T) {
			if !inChild(t) {
				return
			}
			checkNoFDLeak(t, kerneltest.OpenFDs)
			p := newTestPKI(t)
			scfg, ccfg := p.configs(connCases[0])
			Probe() // before the filter, which would make it fail
			denySetsockopt(t, tc.level, tc.opt)
			var rec eventRecorder
			opts := Options{Observer: rec.observe}
			before := Stats()
			d := statDelta(t, func() {
				pr, err := dialPair(t, scfg, ccfg, opts, nil)
				if err != nil {
					t.Fatal(err)
				}
				if off := pr.server.Offload(); off.Reason != tc.reason || off.TX != ModeUserspace || off.RX != ModeUserspace {
					t.Fatalf("Offload() = %+v, want %q with both directions in userspace", off, tc.reason)
				}
				rc, err := pr.server.SyscallConn()
				if err != nil {
					t.Fatal(err)
				}
				var ulp string
				if err := controlFD(rc, func(fd int) (err error) {
					ulp, err = unix.GetsockoptString(fd, unix.IPPROTO_TCP, unix.TCP_ULP)
					return err
				}); err != nil || ulp != tc.ulp {
					t.Fatalf("getsockopt(TCP_ULP) = %q, %v; want %q", ulp, err, tc.ulp)
				}
				exchange(t, pr, bulkSize(t, defaultBulkMiB))
				pr.close()
			})
			wantStat(t, d, "TlsTxSw", 0)
			wantStat(t, d, "TlsRxSw", 0)
			after := Stats()
			if got := after.Outcomes[tc.reason] - before.Outcomes[tc.reason]; got != 1 || after.ClosedAfterTX != before.ClosedAfterTX {
				t.Errorf("Stats(): outcomes[%s] grew by %d, closed-after-tx by %d; want 1, 0",
					tc.reason, got, after.ClosedAfterTX-before.ClosedAfterTX)
			}
			if events := rec.seen(); len(events) != 1 || events[0].Kind != EventHandshake || events[0].Offload.Reason != tc.reason || !errors.Is(events[0].Err, unix.EPERM) {
				t.Fatalf("observer events %+v, want one handshake event with %q and the filter's EPERM", events, tc.reason)
			}
		})
	}
}

// denySetsockopt installs, on every thread of this process, a seccomp
// filter under which setsockopt(fd, level, opt, …) fails with EPERM and
// every other system call runs as usual. Irreversible: child processes
// only (inChild).
func denySetsockopt(t *testing.T, level, opt uint32) {
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
		{Code: jeq, K: level, Jf: 3},
		{Code: load, K: 16 + 8*2},
		{Code: jeq, K: opt, Jf: 1},
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
