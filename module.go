// Package caddyktls is the Caddy glue of caddy-ktls: it registers the Caddy
// modules and subcommands that move TLS sessions into the Linux kernel (kTLS)
// after Caddy's own handshake, and the caddy-l4 handlers that carry sandbox
// tunnels with splice(2).
//
// The mechanisms live in packages that import no Caddy code:
//   - ktls: moves a crypto/tls session into the kernel (TLS_TX/TLS_RX), with
//     a userspace fallback behind the same API;
//   - splice: the zero-copy data path between two sockets;
//   - preamble: the signed sandbox preamble (wire format, keys, signing,
//     verification);
//   - forward: the forwarder that serves one tunnel (preamble, policy, dial,
//     relay, registry, activity reports);
//   - gateway: the edge gateway's side (dial a forwarder, sign, relay, look
//     a sandbox up in the control plane).
//
// This package stays thin: configuration, Caddyfile parsing, logging and
// metrics wiring. One file per module:
//
//	listenerwrapper.go  caddy.listeners.ktls           the HTTP server's listener wrapper
//	l4handler.go        layer4.handlers.ktls           TLS termination and offload in caddy-l4
//	ktlssession.go      layer4.handlers.ktls_session   HTTP on a kTLS session inside caddy-l4
//	sandboxhandler.go   layer4.handlers.sandbox        the tunnel forwarder
//	matcher.go          layer4.matchers.sandbox        routes connections that start with a preamble
//	admin.go            admin.api.sandbox              GET /sandbox/tunnels and /sandbox/activity
//	sandboxtransport.go http.reverse_proxy.transport.sandbox  the edge gateway for HTTP
//	sandboxproxy.go     layer4.handlers.sandbox_proxy  the edge gateway for raw TCP
//	sandboxlookup.go    http.handlers.sandbox_lookup   where a sandbox is, from the control plane
//	sandboxlookupl4.go  layer4.handlers.sandbox_lookup the same for layer4
//
// and beside them: caddyfile.go (all Caddyfile parsing), offloadoptions.go
// (the options the two TLS-terminating modules share), gatewaydial.go (how
// the two gateway modules reach forwarders), state.go (what outlives a
// configuration load), metrics.go and gatewaymetrics.go, tlsplaceholders.go,
// acceptretry.go (the tcp-retry network), commands.go and sandboxcmd.go (the
// `caddy ktls` and `caddy sandbox` subcommands).
package caddyktls

// The module IDs, also the `module` label of the metrics.
const (
	moduleListenerWrapper   = "caddy.listeners.ktls"
	moduleL4Handler         = "layer4.handlers.ktls"
	moduleKTLSSession       = "layer4.handlers.ktls_session"
	moduleSandboxHandler    = "layer4.handlers.sandbox"
	moduleSandboxMatcher    = "layer4.matchers.sandbox"
	moduleAdminSandbox      = "admin.api.sandbox"
	moduleSandboxProxy      = "layer4.handlers.sandbox_proxy"
	moduleSandboxTransport  = "http.reverse_proxy.transport.sandbox"
	moduleSandboxLookupHTTP = "http.handlers.sandbox_lookup"
	moduleSandboxLookupL4   = "layer4.handlers.sandbox_lookup"
)
