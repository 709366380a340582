package ktls

import (
	"crypto/tls"
	"errors"
	"fmt"
	"os"
	"reflect"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
)

// wantProbeSuites are the version/suite pairs every kernel of the test
// matrix (Debian 6.1, 6.12, 7.3, all CONFIG_TLS=m) accepts in both
// directions once tls and the AEAD modules are loaded (ChaCha20-Poly1305
// since Linux 5.11, for TLS 1.2 and 1.3 alike).
var wantProbeSuites = []struct{ version, suite uint16 }{
	{tls.VersionTLS13, tls.TLS_AES_128_GCM_SHA256},
	{tls.VersionTLS13, tls.TLS_AES_256_GCM_SHA384},
	{tls.VersionTLS13, tls.TLS_CHACHA20_POLY1305_SHA256},
	{tls.VersionTLS12, tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256},
	{tls.VersionTLS12, tls.TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384},
	{tls.VersionTLS12, tls.TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256},
}

// unameRelease is the running kernel's release string.
func unameRelease(t *testing.T) string {
	t.Helper()
	var uts unix.Utsname
	if err := unix.Uname(&uts); err != nil {
		t.Fatalf("uname: %v", err)
	}
	return unix.ByteSliceToString(uts.Release[:])
}

// kernelAtLeast reports whether a release like "6.1.0-57-amd64" or
// "7.3.4+deb13-amd64" is at least major.minor. Only the tests derive
// expectations from version numbers; Probe itself must find out by trying.
func kernelAtLeast(t *testing.T, release string, major, minor int) bool {
	t.Helper()
	parts := strings.SplitN(release, ".", 3)
	if len(parts) < 2 {
		t.Fatalf("kernel release %q: want major.minor...", release)
	}
	maj, err1 := strconv.Atoi(parts[0])
	mnr, err2 := strconv.Atoi(strings.TrimRightFunc(parts[1], func(r rune) bool { return r < '0' || r > '9' }))
	if err1 != nil || err2 != nil {
		t.Fatalf("kernel release %q: cannot parse major.minor", release)
	}
	return maj > major || maj == major && mnr >= minor
}

func TestKernelAtLeast(t *testing.T) {
	for _, tc := range []struct {
		release      string
		major, minor int
		want         bool
	}{
		{"6.1.0-57-amd64", 6, 0, true},
		{"6.1.0-57-amd64", 6, 14, false},
		{"6.12.118+deb13-amd64", 6, 14, false},
		{"6.14.2", 6, 14, true},
		{"7.3.4+deb13-amd64", 6, 14, true},
		{"5.15.0-100-generic", 6, 0, false},
	} {
		if got := kernelAtLeast(t, tc.release, tc.major, tc.minor); got != tc.want {
			t.Errorf("kernelAtLeast(%q, %d, %d) = %v, want %v", tc.release, tc.major, tc.minor, got, tc.want)
		}
	}
}

// TestProbeAgreesWithKernelTest: Probe and the shared kerneltest check must
// agree on whether the ULP attaches, on every host.
func TestProbeAgreesWithKernelTest(t *testing.T) {
	if got, want := Probe().ULP == nil, kerneltest.Available() == nil; got != want {
		t.Fatalf("Probe().ULP = %v, kerneltest.Available() = %v", Probe().ULP, kerneltest.Available())
	}
	// The cached answer is what the kernel says now (errors compared by
	// text: a fresh probe makes a new error value).
	cached, fresh := Probe(), probe()
	if fmt.Sprint(cached.ULP) != fmt.Sprint(fresh.ULP) {
		t.Errorf("cached ULP %v, fresh probe %v", cached.ULP, fresh.ULP)
	}
	cached.ULP, fresh.ULP = nil, nil
	if !reflect.DeepEqual(cached, fresh) {
		t.Errorf("cached probe %+v, fresh probe %+v", cached, fresh)
	}
	if cached.Kernel != unameRelease(t) {
		t.Errorf("Probe().Kernel = %q, want the uname release %q", cached.Kernel, unameRelease(t))
	}
}

// capEffNetAdmin reads the CAP_NET_ADMIN bit of the CapEff line of a /proc
// status file: the kernel's own account of the effective set, read without
// capget(2), which hasNetAdmin uses.
func capEffNetAdmin(path string) (bool, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return false, err
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			mask, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			if err != nil {
				return false, fmt.Errorf("%s: CapEff %q: %w", path, v, err)
			}
			return mask&(1<<unix.CAP_NET_ADMIN) != 0, nil
		}
	}
	return false, fmt.Errorf("%s has no CapEff line", path)
}

// TestNetAdminMatchesCapEff: hasNetAdmin and Probe().NetAdmin agree with
// the CapEff bit of /proc/self/status, on every host. Where the process
// holds CAP_NET_ADMIN, one OS thread also drops it from its effective set,
// and hasNetAdmin on that thread must say false, as /proc/thread-self does.
func TestNetAdminMatchesCapEff(t *testing.T) {
	want, err := capEffNetAdmin("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	if got := hasNetAdmin(); got != want {
		t.Errorf("hasNetAdmin() = %v, CapEff says %v", got, want)
	}
	if got := Probe().NetAdmin; got != want {
		t.Errorf("Probe().NetAdmin = %v, CapEff says %v", got, want)
	}
	if !want {
		t.Log("no CAP_NET_ADMIN in this process: the dropped-capability case needs it to start with")
		return
	}
	errc := make(chan error, 1)
	go func() {
		// Never unlocked: the thread, with its reduced capabilities, exits
		// with this goroutine instead of going back to the scheduler. The
		// main thread cannot exit (the runtime parks it instead), and
		// /proc/self/status reports its capabilities: it must keep them.
		// While this goroutine holds it locked, another one runs elsewhere.
		runtime.LockOSThread()
		if unix.Gettid() != unix.Getpid() {
			errc <- dropNetAdminAndCheck()
			return
		}
		defer runtime.UnlockOSThread()
		inner := make(chan error, 1)
		go func() {
			runtime.LockOSThread()
			inner <- dropNetAdminAndCheck()
		}()
		errc <- <-inner
	}()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	if !hasNetAdmin() {
		t.Fatal("hasNetAdmin() = false on another thread after one thread dropped CAP_NET_ADMIN")
	}
}

// dropNetAdminAndCheck clears CAP_NET_ADMIN from the calling thread's
// effective set and checks what hasNetAdmin and /proc/thread-self report.
func dropNetAdminAndCheck() error {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capget: %w", err)
	}
	data[unix.CAP_NET_ADMIN/32].Effective &^= 1 << (unix.CAP_NET_ADMIN % 32)
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capset: %w", err)
	}
	if hasNetAdmin() {
		return errors.New("hasNetAdmin() = true on a thread without CAP_NET_ADMIN in its effective set")
	}
	if has, err := capEffNetAdmin("/proc/thread-self/status"); err != nil || has {
		return fmt.Errorf("/proc/thread-self/status CapEff has CAP_NET_ADMIN %v (%v) after capset dropped it", has, err)
	}
	return nil
}

// TestProbeWithoutKernelTLS checks what Probe reports on a kernel without
// kTLS: the ULP error, nothing else. A kernel with kTLS is TestKernelProbe's.
func TestProbeWithoutKernelTLS(t *testing.T) {
	if kerneltest.Available() == nil {
		t.Skip("this kernel has kTLS: TestKernelProbe checks the probe here")
	}
	before := kerneltest.OpenFDs(t)
	caps := probe()
	if after := kerneltest.OpenFDs(t); after != before {
		t.Errorf("probe leaked file descriptors: %d before, %d after", before, after)
	}
	if !errors.Is(caps.ULP, unix.ENOENT) {
		t.Fatalf("ULP = %v, want ENOENT (no CONFIG_TLS on this host)", caps.ULP)
	}
	if len(caps.Ciphers) != 0 || caps.ExpectNoPad || caps.TXZeroCopyRO || caps.Rekey {
		t.Errorf("probe without a ULP reported features: %+v", caps)
	}
	if caps.Kernel != unameRelease(t) {
		t.Errorf("Kernel = %q, want uname release %q", caps.Kernel, unameRelease(t))
	}
	if caps.Supports(tls.VersionTLS13, tls.TLS_AES_128_GCM_SHA256, false) {
		t.Error("Supports(TLS 1.3, AES-128-GCM) = true without a ULP")
	}
	s := caps.String()
	for _, want := range []string{"tls ULP:", "unavailable", caps.ULP.Error(), caps.Kernel} {
		if !strings.Contains(s, want) {
			t.Errorf("String() lacks %q:\n%s", want, s)
		}
	}
	if strings.Contains(s, "TX yes") {
		t.Errorf("String() lists ciphers without a ULP:\n%s", s)
	}
}

// TestKernelProbe runs the probe on a kTLS kernel and checks it against
// what the kernel is known to support, and the kernel's own counters against
// what the probe says it installed.
func TestKernelProbe(t *testing.T) {
	kerneltest.Require(t)
	release := unameRelease(t)
	// The first file this process opens may start the runtime's netpoller
	// (an epoll fd and an eventfd that stay open): read tls_stat once before
	// counting, so that the count compares like with like.
	if _, err := kerneltest.ReadStat(); err != nil {
		t.Fatalf("read tls_stat: %v", err)
	}
	before := kerneltest.OpenFDs(t)
	var caps Capabilities
	delta := kerneltest.StatDelta(t, func() { caps = probe() })
	if after := kerneltest.OpenFDs(t); after != before {
		t.Errorf("probe leaked file descriptors: %d before, %d after", before, after)
	}
	t.Logf("probe on %s:\n%s", release, caps)
	if caps.ULP != nil {
		t.Fatalf("ULP = %v, want nil", caps.ULP)
	}
	if caps.Kernel != release {
		t.Errorf("Kernel = %q, want %q", caps.Kernel, release)
	}
	if netAdmin, err := capEffNetAdmin("/proc/self/status"); err != nil || caps.NetAdmin != netAdmin {
		t.Errorf("NetAdmin = %v, CapEff of /proc/self/status says %v (%v)", caps.NetAdmin, netAdmin, err)
	}
	for _, w := range wantProbeSuites {
		name := fmt.Sprintf("%s %s", tls.VersionName(w.version), tls.CipherSuiteName(w.suite))
		i := slices.IndexFunc(caps.Ciphers, func(c CipherSupport) bool { return c.Version == w.version && c.CipherSuite == w.suite })
		if i < 0 {
			t.Errorf("%s: not probed: %+v", name, caps.Ciphers)
		} else if c := caps.Ciphers[i]; !c.TX || !c.RX || c.Name != tls.CipherSuiteName(w.suite) {
			t.Errorf("%s: probe entry %+v, want TX and RX accepted", name, c)
		}
		if !caps.Supports(w.version, w.suite, true) {
			t.Errorf("%s: Supports = false: %+v", name, caps.Ciphers)
		}
	}
	var txOK, rxOK int64
	for _, c := range caps.Ciphers {
		if !c.TX || !c.RX {
			t.Errorf("%s %s: TX %v RX %v, want both accepted", tls.VersionName(c.Version), c.Name, c.TX, c.RX)
		}
		if c.TX {
			txOK++
		}
		if c.RX {
			rxOK++
		}
	}
	if len(caps.Ciphers) < len(wantProbeSuites) {
		t.Errorf("probe tried %d suites, want at least %d", len(caps.Ciphers), len(wantProbeSuites))
	}
	// TLS_RX_EXPECT_NO_PAD and TLS_TX_ZEROCOPY_RO arrived in 6.0.
	if want := kernelAtLeast(t, release, 6, 0); caps.ExpectNoPad != want || caps.TXZeroCopyRO != want {
		t.Errorf("ExpectNoPad %v, TXZeroCopyRO %v on %s: want %v", caps.ExpectNoPad, caps.TXZeroCopyRO, release, want)
	}
	// TLS 1.3 key update (a second TLS_TX) arrived in 6.14.
	wantRekey := kernelAtLeast(t, release, 6, 14)
	if caps.Rekey != wantRekey {
		t.Errorf("Rekey = %v on %s, want %v", caps.Rekey, release, wantRekey)
	}
	// Every accepted first install creates one software context; a rekey
	// replaces keys in place and is counted apart.
	if delta["TlsTxSw"] != txOK || delta["TlsRxSw"] != rxOK {
		t.Errorf("tls_stat TlsTxSw +%d TlsRxSw +%d, want +%d +%d (the accepted installs)", delta["TlsTxSw"], delta["TlsRxSw"], txOK, rxOK)
	}
	if wantRekey && delta["TlsTxRekeyOk"] != 1 {
		t.Errorf("tls_stat TlsTxRekeyOk +%d after the rekey probe, want +1", delta["TlsTxRekeyOk"])
	}
	if s := caps.String(); !strings.Contains(s, "tls ULP:          ok") {
		t.Errorf("String() does not report the ULP as ok:\n%s", s)
	}
}
