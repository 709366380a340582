package edgegateway

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/ktlsingress/caddy-ktls/gateway"
	"github.com/ktlsingress/caddy-ktls/internal/caddymetrics"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// The gateway modules' counters, process-level like the other metrics.
var (
	GatewayDials = caddymetrics.NewCounterFamily(prometheus.CounterOpts{
		Name: "caddy_ktls_gateway_dials_total",
		Help: "Tunnels the gateway modules tried to open, by module and result: ok, no-route (the placeholders gave no valid forwarder, sandbox or target), draining (the process was exiting: nothing was dialed), user-gone (the user reset, or ended without close_notify, before the tunnel opened: no preamble was sent), overloaded (the forwarder shed the connection before its TLS handshake: its max_handshakes were in progress, or its scheduling delay was above max_scheduling_delay), or the step that failed (connect, handshake, preamble). Nothing reached a sandbox unless ok.",
	}, []string{"module", "result"}, moduleid.Gateway, GatewayDialResults)
	GatewayResumed = caddymetrics.NewCounterFamily(prometheus.CounterOpts{
		Name: "caddy_ktls_gateway_dials_resumed_total",
		Help: "Of the gateway modules' ok dials, those whose TLS session with the forwarder resumed an earlier one (resumption on): no certificate verified, nothing signed in the handshake.",
	}, []string{"module"}, moduleid.Gateway)
	GatewayStandby = caddymetrics.NewCounterFamily(prometheus.CounterOpts{
		Name: "caddy_ktls_gateway_standby_total",
		Help: "Standby connections of the gateway modules (standby: mutual TLS done, no preamble yet), by module and how each ended (outcome): used (a tunnel went on it), expired (closed unused after standby_max_idle), lost (the forwarder had ended it when a tunnel wanted it), failed (opening one failed).",
	}, []string{"module", "outcome"}, moduleid.Gateway, gateway.StandbyOutcomes())
	GatewayEnds = caddymetrics.NewCounterFamily(prometheus.CounterOpts{
		Name: "caddy_ktls_gateway_tunnel_ends_total",
		Help: "Opened gateway tunnels by module and how they ended: closed (in order), refused (the forwarder's access_denied: nothing reached the sandbox), failed (internal_error, a reset, a timeout), drained (still open at exit when the drain grace period ended: closed as a failure).",
	}, []string{"module", "end"}, moduleid.Gateway, []string{string(gateway.EndClosed), string(gateway.EndRefused), string(gateway.EndFailed), string(gateway.EndDrained)})
	gatewayRelayBytes = caddymetrics.NewCounterFamily(prometheus.CounterOpts{
		Name: "caddy_ktls_gateway_relay_bytes_total",
		Help: "Bytes the layer4 sandbox_proxy relayed, both directions, by data path: splice (never in userspace) or copy.",
	}, []string{"path"}, []string{relayPathSplice, relayPathCopy})
)

// The caddy_ktls_gateway_dials_total results besides the failed steps.
const (
	gatewayDialOK         = "ok"
	gatewayDialNoRoute    = "no-route"
	gatewayDialOverloaded = "overloaded"
	gatewayDialDraining   = "draining"
	gatewayDialUserGone   = "user-gone"
)

// GatewayDialResults are the results a gateway module counts a dial as:
// ok, no-route, draining, user-gone, overloaded, or the step that failed
// (dialResult).
var GatewayDialResults = []string{gatewayDialOK, gatewayDialNoRoute, gatewayDialDraining, gatewayDialUserGone, gatewayDialOverloaded, gateway.StepConnect, gateway.StepHandshake, gateway.StepPreamble}

// The relay byte paths.
const (
	relayPathSplice = "splice"
	relayPathCopy   = "copy"
)

func init() {
	caddymetrics.Add(moduleid.Gateway, GatewayDials, GatewayResumed, GatewayStandby, GatewayEnds)
	caddymetrics.Add(moduleid.Relay, gatewayRelayBytes)
}

// countDialOK counts module's opened tunnel, and whether its session
// resumed.
func countDialOK(module string, tunnel *ktls.Conn) {
	GatewayDials.WithLabelValues(module, gatewayDialOK).Inc()
	if tunnel.ConnectionState().DidResume {
		GatewayResumed.WithLabelValues(module).Inc()
	}
}
