package offload

import (
	"fmt"

	"github.com/ktlsingress/caddy-ktls/ktls"
)

// EnableHint is what to do when the tls ULP does not attach and the
// kernel has (or may have) the tls module.
const EnableHint = "to enable: modprobe tls (the kernel autoloads it only for a caller with CAP_NET_ADMIN); " +
	"to load it at boot: echo tls > /etc/modules-load.d/tls.conf"

// ProbeHint says what to do when the tls ULP does not attach, by what the
// kernel's build configuration says of CONFIG_TLS: no modprobe advice for
// a kernel built without it, where no module exists to load.
func ProbeHint(cfg ktls.KernelConfig) string {
	switch cfg.TLS {
	case ktls.KernelTLSAbsent:
		return fmt.Sprintf("this kernel was built without CONFIG_TLS (%s says so): it has no kernel TLS and no tls module to load; "+
			"kernel TLS needs a kernel built with CONFIG_TLS=m or =y (most distribution kernels have it as a module)", cfg.Source)
	case ktls.KernelTLSBuiltin:
		return fmt.Sprintf("this kernel has CONFIG_TLS=y built in (%s says so), so no module is missing: "+
			"something else refuses the tls ULP (a seccomp filter, an LSM policy, or a container runtime)", cfg.Source)
	case ktls.KernelTLSModule:
		return EnableHint
	}
	where := "no kernel configuration was read"
	if cfg.Source != "" {
		where = "no readable kernel configuration at " + cfg.Source
	}
	return "could not tell whether this kernel was built with CONFIG_TLS (" + where + "); " +
		"if it was, as a module: " + EnableHint
}
