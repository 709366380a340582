// Package kerneltest is what kTLS tests share: an honest skip when the
// running kernel has no kTLS, and the kernel's own counters from
// /proc/net/tls_stat to prove that the kernel path ran.
//
// A kTLS test calls Require first. On a host without kTLS it prints
// "SKIP: <reason>" and is reported as skipped, never as passed. Inside the
// project's VM harness (KTLS_REQUIRE=1 in the environment) the same missing
// support is a failure, because there a skip would hide a broken kernel path.
package kerneltest

import (
	"bufio"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/internal/loopback"
)

// RequireEnv names the environment variable the VM harness sets: when it is
// "1", a kTLS test that cannot run fails instead of skipping.
const RequireEnv = "KTLS_REQUIRE"

var (
	availOnce sync.Once
	availErr  error
)

// Available reports whether this process can attach the "tls" ULP to a TCP
// socket, by trying it on a throwaway loopback connection (the kernel answers
// ENOENT when CONFIG_TLS is off or the module is not loaded).
func Available() error {
	availOnce.Do(func() { availErr = tryULP() })
	return availErr
}

func tryULP() error {
	return loopback.WithConn(func(fd int) error {
		// The ULP can only be attached to an established socket.
		if err := unix.SetsockoptString(fd, unix.IPPROTO_TCP, unix.TCP_ULP, "tls"); err != nil {
			return fmt.Errorf("kernel TLS unavailable: setsockopt(TCP_ULP, \"tls\"): %w", err)
		}
		return nil
	})
}

// Required reports whether the environment demands that kTLS tests run.
func Required() bool { return os.Getenv(RequireEnv) == "1" }

// Prefix starts the name of every test that calls Require: the VM harness
// runs only the tests named so (-test.run ^TestKernel).
const Prefix = "TestKernel"

// Require skips t loudly when the kernel has no kTLS, or fails it when the
// harness demands kTLS (KTLS_REQUIRE=1). It fails a test whose top-level
// name lacks Prefix, on every kernel: the VM would never run it.
func Require(t testing.TB) {
	t.Helper()
	if top, _, _ := strings.Cut(t.Name(), "/"); !strings.HasPrefix(top, Prefix) {
		t.Fatalf("FAIL: %s calls kerneltest.Require but its name lacks the %s prefix: the VM harness would never run it", top, Prefix)
	}
	err := Available()
	if err == nil {
		return
	}
	if Required() {
		t.Fatalf("FAIL: kTLS required (%s=1) but %v", RequireEnv, err)
	}
	fmt.Fprintf(os.Stderr, "SKIP: %s: %v\n", t.Name(), err)
	t.Skipf("SKIP: %v", err)
}

// BulkEnv names the environment variable that sets, in MiB, the size of
// each test's bulk transfer (each way), in every package: the handshake
// shapes of the kTLS matrix, the relay and forwarder transfers, the
// listener wrapper's file. Transfers that only carry a handshake, a close
// or a control record stay at their fixed small size. Unset, tests move
// their default (a few MiB: the VM emulates AES slowly); a full-size run
// sets 64.
const BulkEnv = "KTLS_TEST_MIB"

// BulkMiB is the size in MiB of a bulk transfer: BulkEnv when set, else def.
func BulkMiB(t testing.TB, def int) int {
	t.Helper()
	return PositiveEnv(t, BulkEnv, def)
}

// PositiveEnv reads a positive integer from the environment variable name,
// or returns def when it is unset. It fails t on anything else.
func PositiveEnv(t testing.TB, name string, def int) int {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		t.Fatalf("%s=%q: want a positive integer", name, v)
	}
	return n
}

// Stat is a snapshot of /proc/net/tls_stat (counters of this network namespace).
type Stat map[string]int64

// ReadStat reads /proc/net/tls_stat. It fails when the file is absent, which is
// the case on kernels without CONFIG_TLS or before the tls module is loaded.
func ReadStat() (Stat, error) {
	f, err := os.Open("/proc/net/tls_stat")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	s := Stat{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) != 2 {
			continue
		}
		v, err := strconv.ParseInt(fields[1], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("tls_stat line %q: %w", sc.Text(), err)
		}
		s[fields[0]] = v
	}
	return s, sc.Err()
}

// Sub returns s minus before, counter by counter.
func (s Stat) Sub(before Stat) Stat {
	d := Stat{}
	for k, v := range s {
		d[k] = v - before[k]
	}
	return d
}

// InstalledOnce fails t unless, since before, the kernel installed exactly
// n sessions each way and authenticated every record (no TlsDecryptError):
// a session that moves between owners is not installed again where it is
// adopted. It returns the counters' moves.
func InstalledOnce(t testing.TB, before Stat, n int64) Stat {
	t.Helper()
	after, err := ReadStat()
	if err != nil {
		t.Fatalf("read tls_stat: %v", err)
	}
	d := after.Sub(before)
	if d["TlsDecryptError"] != 0 || d["TlsTxSw"] != n || d["TlsRxSw"] != n {
		t.Errorf("tls_stat deltas %v: want no decrypt error and exactly %d sessions installed each way (none again at an adoption)", d, n)
	}
	return d
}

// StatDelta runs fn and returns how the tls_stat counters moved meanwhile.
// It fails t when the counters cannot be read.
func StatDelta(t testing.TB, fn func()) Stat {
	t.Helper()
	before, err := ReadStat()
	if err != nil {
		t.Fatalf("read tls_stat: %v", err)
	}
	fn()
	after, err := ReadStat()
	if err != nil {
		t.Fatalf("read tls_stat: %v", err)
	}
	return after.Sub(before)
}

// OpenFDs counts this process's open file descriptors, for leak checks.
func OpenFDs(t testing.TB) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatalf("count fds: %v", err)
	}
	return len(ents)
}

// SocketFD returns the descriptor of c's socket, for a test's ioctl and
// setsockopt; it stays c's.
func SocketFD(t testing.TB, c syscall.Conn) int {
	t.Helper()
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	fd := -1
	if err := rc.Control(func(f uintptr) { fd = int(f) }); err != nil {
		t.Fatal(err)
	}
	return fd
}

// Inq returns the bytes TCP holds unread on the socket fd (SIOCINQ): on a
// kTLS socket, what the record parser has not taken.
func Inq(t testing.TB, fd int) int {
	t.Helper()
	n, err := unix.IoctlGetInt(fd, unix.SIOCINQ)
	if err != nil {
		t.Fatalf("SIOCINQ: %v", err)
	}
	return n
}

// WaitIOWait waits until a goroutine of this process whose stack holds
// every one of frames is parked in the netpoller (IO wait), failing t
// after 10 s.
func WaitIOWait(t testing.TB, frames ...string) {
	t.Helper()
	buf := make([]byte, 1<<20)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		for _, g := range strings.Split(string(buf[:runtime.Stack(buf, true)]), "\n\n") {
			if strings.Contains(g, "[IO wait") && containsAll(g, frames) {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no goroutine in %s parked for readability", strings.Join(frames, " and "))
		}
	}
}

func containsAll(s string, subs []string) bool {
	for _, sub := range subs {
		if !strings.Contains(s, sub) {
			return false
		}
	}
	return true
}
