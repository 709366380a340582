package edgegateway

import (
	"fmt"
	"net"
	"net/netip"
	"strings"
)

// RefusedGatewayTLSOptions are the TLS options of reverse_proxy's http
// transport that a gateway module refuses, by Caddyfile name, with why
// and what to use instead. The JSON load (DialOptions.validate) and the
// Caddyfile parser say the same.
var RefusedGatewayTLSOptions = map[string]string{
	"tls_insecure_skip_verify": "the preamble would go to whoever answers; give the forwarders' CA with tls_trust_pool",
	"tls_timeout":              "use handshake_timeout, the offload options' name for it (it bounds each forwarder connection's TLS handshake)",
	"tls_except_ports":         "every forwarder connection is TLS",
}

// LookupURLHint says what a sandbox_lookup's url is, for the errors of one
// that has none.
const LookupURLHint = "give the control plane's endpoint, with {sandbox} where the sandbox ID goes, " +
	"e.g. url https://cp.internal/v1/sandboxes/{sandbox}/route (docs/gateway.md, Finding the sandbox)"

// checkTargetOption refuses a gateway module's target option that holds
// no placeholder and is no IP address and port: every connection or
// request would fail with it (the forwarder does no DNS). A value with a
// placeholder is checked after replacement (gateway.ParseRoute).
func checkTargetOption(module, value string) error {
	if strings.Contains(value, "{") {
		return nil
	}
	if _, err := netip.ParseAddrPort(value); err != nil {
		return fmt.Errorf("%s: `target` %q: want the app's private IP address and port, such as 10.1.0.7:8080 or [fd00::7]:8080, "+
			"never a host name (the forwarder does no DNS: resolve it in the control plane, or use a placeholder such as {vars.sandbox_target})", module, value)
	}
	return nil
}

// checkForwarderOption refuses sandbox_proxy's forwarder option that holds
// no placeholder and is no host:port.
func checkForwarderOption(module, value string) error {
	if strings.Contains(value, "{") {
		return nil
	}
	if _, port, err := net.SplitHostPort(value); err != nil || port == "" {
		return fmt.Errorf("%s: `forwarder` %q: want the forwarder's host:port, such as 10.0.0.5:8443", module, value)
	}
	return nil
}
