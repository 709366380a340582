package ktls

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
)

// KernelTLS is how the running kernel was built with CONFIG_TLS, the option
// that provides the "tls" upper layer protocol, as its build configuration
// says.
type KernelTLS uint8

const (
	// KernelTLSUnknown: no readable kernel configuration; nothing can be
	// said about CONFIG_TLS.
	KernelTLSUnknown KernelTLS = iota
	// KernelTLSBuiltin: CONFIG_TLS=y, built into the kernel image.
	KernelTLSBuiltin
	// KernelTLSModule: CONFIG_TLS=m, the tls module, loaded on demand or
	// with modprobe.
	KernelTLSModule
	// KernelTLSAbsent: "# CONFIG_TLS is not set" (or no CONFIG_TLS line at
	// all): this kernel has no kTLS, and no module to load gives it one.
	KernelTLSAbsent
)

// String returns "y", "m", "not set" or "unknown".
func (k KernelTLS) String() string {
	switch k {
	case KernelTLSBuiltin:
		return "y"
	case KernelTLSModule:
		return "m"
	case KernelTLSAbsent:
		return "not set"
	}
	return "unknown"
}

// KernelConfig is what a kernel build configuration says about CONFIG_TLS.
type KernelConfig struct {
	TLS KernelTLS
	// Source is the file the answer came from; when TLS is
	// KernelTLSUnknown, the files that were tried, comma-separated.
	Source string
}

// KernelConfigPaths returns where a kernel's build configuration usually
// is: /boot/config-<release> (distributions install it there) and
// /proc/config.gz (CONFIG_IKCONFIG_PROC), in that order.
func KernelConfigPaths(release string) []string {
	var paths []string
	if release != "" {
		paths = append(paths, "/boot/config-"+release)
	}
	return append(paths, "/proc/config.gz")
}

// ReadKernelConfig reads CONFIG_TLS from the first of paths that holds a
// readable kernel configuration (a name ending in .gz is gunzipped). A file
// that cannot be read, or does not look like a kernel configuration, is
// skipped; when none is left the answer is KernelTLSUnknown.
func ReadKernelConfig(paths ...string) KernelConfig {
	for _, p := range paths {
		if tlsOpt, err := readKernelConfigFile(p); err == nil {
			return KernelConfig{TLS: tlsOpt, Source: p}
		}
	}
	return KernelConfig{TLS: KernelTLSUnknown, Source: strings.Join(paths, ", ")}
}

// errNotKernelConfig says a file holds no CONFIG_ line at all.
var errNotKernelConfig = errors.New("ktls: not a kernel configuration")

func readKernelConfigFile(path string) (KernelTLS, error) {
	f, err := os.Open(path)
	if err != nil {
		return KernelTLSUnknown, err
	}
	defer f.Close()
	var r io.Reader = f
	if strings.HasSuffix(path, ".gz") {
		gz, err := gzip.NewReader(f)
		if err != nil {
			return KernelTLSUnknown, fmt.Errorf("ktls: %s: %w", path, err)
		}
		defer gz.Close()
		r = gz
	}
	return parseKernelConfig(r)
}

// parseKernelConfig finds CONFIG_TLS in a .config. Kconfig writes
// "# CONFIG_TLS is not set" for a visible option that is off, and nothing
// when the option is hidden (CONFIG_NET off): both mean no kTLS.
func parseKernelConfig(r io.Reader) (KernelTLS, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	sawConfig := false
	for sc.Scan() {
		line := bytes.TrimSpace(sc.Bytes())
		switch {
		case bytes.Equal(line, []byte("CONFIG_TLS=y")):
			return KernelTLSBuiltin, nil
		case bytes.Equal(line, []byte("CONFIG_TLS=m")):
			return KernelTLSModule, nil
		case bytes.Equal(line, []byte("# CONFIG_TLS is not set")):
			return KernelTLSAbsent, nil
		case bytes.HasPrefix(line, []byte("CONFIG_")), bytes.HasPrefix(line, []byte("# CONFIG_")):
			sawConfig = true
		}
	}
	if err := sc.Err(); err != nil {
		return KernelTLSUnknown, err
	}
	if !sawConfig {
		return KernelTLSUnknown, errNotKernelConfig
	}
	return KernelTLSAbsent, nil
}
