package ktls

import (
	"crypto/tls"
	"fmt"
	"slices"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/internal/loopback"
)

// Capabilities is what this kernel accepts, found by trying setsockopt on
// throwaway loopback connections (never by parsing version numbers: distro
// kernels backport features and modules may be absent).
type Capabilities struct {
	// ULP is nil if the "tls" upper layer protocol attaches to a TCP socket;
	// otherwise why not (ENOENT: no CONFIG_TLS, or module not loaded and the
	// process may not autoload it).
	ULP error
	// NetAdmin reports whether the process holds CAP_NET_ADMIN: the kernel
	// autoloads the tls module on TCP_ULP only for such a caller.
	NetAdmin bool
	// Ciphers lists TLS 1.2 and 1.3 × AES-128-GCM, AES-256-GCM,
	// ChaCha20-Poly1305 with whether TLS_TX and TLS_RX accepted them.
	Ciphers []CipherSupport
	// ExpectNoPad reports whether TLS_RX_EXPECT_NO_PAD is accepted.
	ExpectNoPad bool
	// TXZeroCopyRO reports whether TLS_TX_ZEROCOPY_RO is accepted.
	TXZeroCopyRO bool
	// Rekey reports whether a second TLS_TX on a TLS 1.3 socket is accepted
	// (KeyUpdate support, Linux >= 6.14).
	Rekey bool
	// Kernel is the uname release, informational only.
	Kernel string
	// Config is what the kernel's build configuration says of CONFIG_TLS.
	// Probe reads it only when ULP fails (to tell a kernel built without
	// kTLS from one whose module is not loaded); otherwise it is zero.
	Config KernelConfig
}

// CipherSupport says whether the kernel took one version/suite pair for
// each direction.
type CipherSupport struct {
	Version     uint16
	CipherSuite uint16
	Name        string
	TX, RX      bool
}

// Supports reports whether the kernel accepted a version/suite pair for TX
// and, when rxToo, for RX. Suites are compared by the kernel cipher they
// need: the probe tries the RSA-signed TLS 1.2 suites, and their ECDSA twins
// use the same record protection.
func (c Capabilities) Supports(version, suite uint16, rxToo bool) bool {
	want, err := suiteFor(version, suite)
	if c.ULP != nil || err != nil {
		return false
	}
	for _, s := range c.Ciphers {
		if got, err := suiteFor(s.Version, s.CipherSuite); err == nil && s.Version == version && got.kernelCipher == want.kernelCipher {
			return s.TX && (s.RX || !rxToo)
		}
	}
	return false
}

// String renders the capabilities for humans (used by `caddy ktls probe`).
func (c Capabilities) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "kernel:           %s\n", c.Kernel)
	fmt.Fprintf(&b, "CAP_NET_ADMIN:    %v\n", c.NetAdmin)
	if c.ULP != nil {
		fmt.Fprintf(&b, "tls ULP:          unavailable: %v\n", c.ULP)
		fmt.Fprintf(&b, "CONFIG_TLS:       %s", c.Config.TLS)
		if c.Config.Source != "" {
			if c.Config.TLS == KernelTLSUnknown {
				fmt.Fprintf(&b, " (no readable kernel configuration: %s)", c.Config.Source)
			} else {
				fmt.Fprintf(&b, " (%s)", c.Config.Source)
			}
		}
		b.WriteString("\n")
		if !c.NetAdmin && c.Config.TLS != KernelTLSAbsent && c.Config.TLS != KernelTLSBuiltin {
			b.WriteString("                  (without CAP_NET_ADMIN the kernel will not autoload the module: run `modprobe tls`)\n")
		}
		return b.String()
	}
	b.WriteString("tls ULP:          ok\n")
	for _, s := range c.Ciphers {
		fmt.Fprintf(&b, "%-17s %-43s TX %-3s RX %s\n", tls.VersionName(s.Version)+":", s.Name, yesNo(s.TX), yesNo(s.RX))
	}
	fmt.Fprintf(&b, "RX expect no pad: %s\n", yesNo(c.ExpectNoPad))
	fmt.Fprintf(&b, "TX zerocopy RO:   %s\n", yesNo(c.TXZeroCopyRO))
	fmt.Fprintf(&b, "TLS 1.3 rekey:    %s\n", yesNo(c.Rekey))
	return b.String()
}

func yesNo(v bool) string {
	if v {
		return "yes"
	}
	return "no"
}

var (
	probeOnce sync.Once
	probeCaps Capabilities
)

// Probe returns the kernel's kTLS capabilities. The first call tries them on
// loopback sockets; later calls return the cached result.
func Probe() Capabilities {
	probeOnce.Do(func() { probeCaps = probe() })
	return probeCaps
}

// probeSuites returns the rows the probe tries, in table order: the first
// row of each version and kernel cipher. The rows it skips need the same
// crypto_info, so the kernel's answer for the first holds for them too.
func probeSuites() []*cipherSuite {
	var rows []*cipherSuite
	for i := range cipherSuites {
		cs := &cipherSuites[i]
		if !slices.ContainsFunc(rows, func(r *cipherSuite) bool {
			return r.version == cs.version && r.kernelCipher == cs.kernelCipher
		}) {
			rows = append(rows, cs)
		}
	}
	return rows
}

func probe() Capabilities {
	var c Capabilities
	var uts unix.Utsname
	if unix.Uname(&uts) == nil {
		c.Kernel = unix.ByteSliceToString(uts.Release[:])
	}
	c.NetAdmin = hasNetAdmin()
	c.ULP = withULPSocket(func(int) error { return nil })
	if c.ULP != nil {
		c.Config = ReadKernelConfig(KernelConfigPaths(c.Kernel)...)
		return c
	}
	for _, s := range probeSuites() {
		cs := CipherSupport{Version: s.version, CipherSuite: s.id, Name: tls.CipherSuiteName(s.id)}
		// One socket per pair: without rekey support a direction accepts one key only.
		_ = withULPSocket(func(fd int) error {
			cs.TX = installProbeKey(fd, optTLSTX, s) == nil
			cs.RX = installProbeKey(fd, optTLSRX, s) == nil
			if s.version == tls.VersionTLS13 && s.id == tls.TLS_AES_128_GCM_SHA256 {
				c.ExpectNoPad = cs.RX && unix.SetsockoptInt(fd, unix.SOL_TLS, optRXExpectNoPad, 1) == nil
				c.TXZeroCopyRO = cs.TX && unix.SetsockoptInt(fd, unix.SOL_TLS, optTXZeroCopyRO, 1) == nil
				c.Rekey = cs.TX && installProbeKey(fd, optTLSTX, s) == nil
			}
			return nil
		})
		c.Ciphers = append(c.Ciphers, cs)
	}
	return c
}

// installProbeKey installs an all-zero key: the kernel checks only the
// struct, not the key, and no record is ever sent.
func installProbeKey(fd, opt int, cs *cipherSuite) error {
	info, err := cryptoInfo(cs.version, cs.id, make([]byte, cs.keyLen), make([]byte, cs.ivLen), 0)
	if err != nil {
		return err
	}
	return setsockoptBytes(fd, unix.SOL_TLS, opt, info)
}

// withULPSocket connects a throwaway loopback TCP pair, attaches the "tls"
// ULP to the client end (the kernel only attaches it to an ESTABLISHED
// socket: ENOTCONN otherwise) and runs f on it.
func withULPSocket(f func(fd int) error) error {
	return loopback.WithConn(func(fd int) error {
		if err := unix.SetsockoptString(fd, unix.IPPROTO_TCP, unix.TCP_ULP, "tls"); err != nil {
			return fmt.Errorf("setsockopt(TCP_ULP, \"tls\"): %w", err)
		}
		return f(fd)
	})
}

// hasNetAdmin reports whether CAP_NET_ADMIN is in the effective set.
func hasNetAdmin() bool {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return false
	}
	const capNetAdmin = unix.CAP_NET_ADMIN
	return data[capNetAdmin/32].Effective&(1<<(capNetAdmin%32)) != 0
}
