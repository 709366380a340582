// Package moduleid names the Caddy modules of caddy-ktls and what each
// does: one table per fact. A module's ID is also the `module` label of its
// metrics, and the roles below say which metrics a module can move.
package moduleid

import "slices"

// The module IDs.
const (
	ListenerWrapper   = "caddy.listeners.ktls"
	L4Handler         = "layer4.handlers.ktls"
	KTLSSession       = "layer4.handlers.ktls_session"
	SandboxHandler    = "layer4.handlers.sandbox"
	SandboxMatcher    = "layer4.matchers.sandbox"
	AdminSandbox      = "admin.api.sandbox"
	SandboxProxy      = "layer4.handlers.sandbox_proxy"
	SandboxTransport  = "http.reverse_proxy.transport.sandbox"
	SandboxLookupHTTP = "http.handlers.sandbox_lookup"
	SandboxLookupL4   = "layer4.handlers.sandbox_lookup"
	SandboxHandoff    = "sandbox_handoff"
	AdminHandoff      = "admin.api.sandbox_handoff"
)

// The roles: which modules move which metrics. The metrics' series are
// declared from them, and a configuration's registry exports the families
// its loaded modules can move (caddymetrics).
var (
	// Engine serve connections through the kTLS engine: each reports every
	// handshake and every connection the engine ends (offload).
	Engine = []string{ListenerWrapper, L4Handler, SandboxProxy, SandboxTransport}
	// Server accept TLS handshakes and count the failed ones by reason.
	// The gateway modules count theirs as dials that failed at the
	// handshake (caddy_ktls_gateway_dials_total).
	Server = []string{ListenerWrapper, L4Handler}
	// Shedder bound the TLS handshakes they run at once and shed the
	// connections beyond (max_handshakes).
	Shedder = []string{L4Handler}
	// Forwarder carry sandbox tunnels (the registry, the pushers, the
	// wakes).
	Forwarder = []string{SandboxHandler}
	// Gateway open tunnels to forwarders.
	Gateway = []string{SandboxProxy, SandboxTransport}
	// Relay relay a gateway's tunnels themselves (the transport leaves its
	// bytes to net/http).
	Relay = []string{SandboxProxy}
	// Lookup ask the control plane where a sandbox is.
	Lookup = []string{SandboxLookupHTTP, SandboxLookupL4}
	// Any: every module that registers metrics (what any of them may
	// serve, such as a tcp-retry listener).
	Any = slices.Concat(Engine, Forwarder, Lookup)
)
